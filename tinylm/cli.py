"""``rollout tinylm init DIR`` and ``rollout tinylm serve --model DIR --port P``.

``main(argv)`` parses the arguments after ``tinylm`` and returns an exit status; the top-level
``rollout`` command delegates here, and ``python -m tinylm ...`` runs it directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from engine.errors import ConfigError
from tinylm.model import DEFAULT_TRAIN_STEPS, init_model
from tinylm.sampling import LogprobMode
from tinylm.server import ServerConfig, serve

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout tinylm",
        description="A tiny Qwen2-style model and an SGLang-compatible CPU server for it.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    init = sub.add_parser("init", help="create, briefly train and save a tinylm model")
    init.add_argument("dir", type=Path, help="folder to create (must be empty or absent)")
    init.add_argument("--seed", type=int, default=0, help="seed for corpus, weights and training")
    init.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_TRAIN_STEPS,
        help=f"training steps (default {DEFAULT_TRAIN_STEPS}; 0 saves untrained weights)",
    )

    srv = sub.add_parser("serve", help="serve a tinylm model over HTTP (SGLang + OpenAI routes)")
    srv.add_argument("--model", type=Path, required=True, help="folder written by `tinylm init`")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    srv.add_argument(
        "--max-running-requests",
        type=int,
        default=16,
        help="KV-cache slots: requests decoded together in one batch",
    )
    srv.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="cap on prompt + output tokens (default: the model's)",
    )
    srv.add_argument(
        "--logprobs",
        choices=[m.value for m in LogprobMode],
        default=LogprobMode.ORIGINAL.value,
        help="original: log-softmax of raw logits (as SGLANG_RETURN_ORIGINAL_LOGPROB=1); "
        "processed: of the temperature/top-p distribution (SGLang's default)",
    )
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads for the forward (default 1: a tiny model loses to thread sync)",
    )
    srv.add_argument("--log-level", default="warning")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "init":
            report = init_model(
                args.dir,
                seed=args.seed,
                train_steps=args.steps,
                log=lambda msg: print(msg, file=sys.stderr),
            )
            print(json.dumps(asdict(report)))
            return 0
        import torch

        torch.set_num_threads(args.torch_threads)
        logging.basicConfig(
            level=args.log_level.upper(),
            stream=sys.stderr,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
        )
        config = ServerConfig(
            model_dir=args.model,
            host=args.host,
            port=args.port,
            max_running_requests=args.max_running_requests,
            max_context=args.context_length,
            logprob_mode=LogprobMode(args.logprobs),
            served_model_name=args.served_model_name,
        )
        return serve(config, out=lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"rollout tinylm: {exc}", file=sys.stderr)
        return 2
