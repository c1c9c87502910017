"""``rollout tinylm init DIR`` and ``rollout tinylm serve --model DIR --port P``.

``main(argv, system_prompts=...)`` parses the arguments after ``tinylm`` and returns an exit
status. The top-level ``rollout`` command delegates here (``engine.ops.tinylm``) passing the
bundled agents' system prompts, which ``init`` renders the corpus with; ``python -m tinylm
init`` needs them as ``--math-system-prompt`` / ``--shell-system-prompt``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from tinylm.corpus import SystemPrompts
from tinylm.errors import ConfigError
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
    init.add_argument("--math-system-prompt", help="the math agent's system prompt")
    init.add_argument("--shell-system-prompt", help="the shell agent's system prompt")

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
        default=None,
        help="original: log-softmax of raw logits; processed: of the temperature-scaled "
        "logits. Default: as SGLang, original only when SGLANG_RETURN_ORIGINAL_LOGPROB is "
        "1/true (unset: processed, which skews RL importance ratios)",
    )
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument(
        "--weight-version",
        default="default",
        help="version of the loaded weights, reported in every reply (as SGLang's flag)",
    )
    srv.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads for the forward (default 1: a tiny model loses to thread sync)",
    )
    srv.add_argument("--log-level", default="warning")
    for flag, env in (("--api-key-file", API_KEY_ENV), ("--admin-api-key-file", ADMIN_KEY_ENV)):
        srv.add_argument(
            flag,
            type=Path,
            default=None,
            help=f"file holding the {flag[2:-5].replace('-', ' ')} (as SGLang's "
            f"{flag[:-5]}; also ${env}; never on the command line, which every local user "
            "can read)",
        )
    return parser


API_KEY_ENV = "TINYLM_API_KEY"
ADMIN_KEY_ENV = "TINYLM_ADMIN_API_KEY"


def _key(path: Path | None, env: str) -> str | None:
    if path is not None:
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the key file {path}: {exc.strerror}") from exc
        if not key:
            raise ConfigError(f"the key file {path} is empty")
        return key
    return os.environ.get(env) or None


def _prompts(args: argparse.Namespace, given: SystemPrompts | None) -> SystemPrompts:
    math = args.math_system_prompt or (given.math if given else None)
    shell = args.shell_system_prompt or (given.shell if given else None)
    if math is None or shell is None:
        raise ConfigError(
            "init needs the system prompts of the agents the model will serve: run it as "
            "`rollout tinylm init` (the bundled agents' prompts) or give "
            "--math-system-prompt and --shell-system-prompt"
        )
    return SystemPrompts(math=math, shell=shell)


def main(argv: list[str] | None = None, *, system_prompts: SystemPrompts | None = None) -> int:
    """Run ``init`` or ``serve``; ``system_prompts`` are ``init``'s defaults for the flags."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "init":
            report = init_model(
                args.dir,
                system_prompts=_prompts(args, system_prompts),
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
            logprob_mode=None if args.logprobs is None else LogprobMode(args.logprobs),
            served_model_name=args.served_model_name,
            weight_version=args.weight_version,
            api_key=_key(args.api_key_file, API_KEY_ENV),
            admin_api_key=_key(args.admin_api_key_file, ADMIN_KEY_ENV),
        )
        return serve(config, out=lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"rollout tinylm: {exc}", file=sys.stderr)
        return 2
