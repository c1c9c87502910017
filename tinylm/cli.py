"""``rollout tinylm init DIR`` and ``rollout tinylm serve --model-path DIR --port P``.

``main(argv, system_prompts=...)`` parses the arguments after ``tinylm`` and returns an exit
status. The top-level ``rollout`` command delegates here (``engine.ops.tinylm``) passing the
bundled agents' system prompts, which ``init`` renders the corpus with; ``python -m tinylm
init`` needs them as ``--math-system-prompt`` / ``--shell-system-prompt``.

``serve`` takes SGLang 0.5.23's ``launch_server`` flags by their SGLang names, so that a
supervisor launches tinylm with the arguments it would give SGLang:

- the flags tinylm implements: ``--model-path`` (``--model``), ``--host``, ``--port``
  (default 30000), ``--weight-version`` (default ``default``), ``--api-key``,
  ``--admin-api-key``, ``--served-model-name``, ``--max-running-requests``,
  ``--context-length``, ``--log-level``, ``--tokenizer-worker-num`` (what it changes:
  ``server.py``, ``/abort_request``), ``--stream-interval``, ``--incremental-streaming-output``;
- every other flag of SGLang's ``ServerArgs`` (``sglang_server_args.FLAGS``, with its arity)
  is accepted and has no effect on CPU; the server names them on stderr at start;
- tinylm's own: ``--logprobs``, ``--torch-threads``, and ``--api-key-file`` /
  ``--admin-api-key-file`` (or ``$TINYLM_API_KEY`` / ``$TINYLM_ADMIN_API_KEY``), which keep
  a key off the command line, where every local user can read it.

Any other flag is refused at start by argparse, naming it (``unrecognized arguments``), with
exit status 2, as SGLang's ``prepare_server_args`` refuses it. As in SGLang, an unambiguous
prefix of a long flag is taken for it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tinylm.corpus import SystemPrompts
from tinylm.errors import ConfigError
from tinylm.model import DEFAULT_TRAIN_STEPS, init_model
from tinylm.sampling import LogprobMode
from tinylm.server import ServerConfig, serve
from tinylm.sglang_server_args import FLAGS, SGLANG_VERSION

__all__ = ["IMPLEMENTED", "build_parser", "main"]

API_KEY_ENV = "TINYLM_API_KEY"
ADMIN_KEY_ENV = "TINYLM_ADMIN_API_KEY"
_IGNORED = "ignored_sglang_"  # the argparse dest prefix of SGLang flags tinylm does not use

IMPLEMENTED: dict[str, dict[str, Any]] = {
    "model_path": {"required": True, "type": Path, "help": "folder written by `tinylm init`"},
    "host": {"default": "127.0.0.1"},
    "port": {"type": int, "default": 30000, "help": "0 picks a free port"},
    "weight_version": {
        "default": "default",
        "help": "version of the loaded weights, reported in every reply (SGLang's default: "
        "'default')",
    },
    "api_key": {"default": None, "help": "API key (visible in `ps`: prefer --api-key-file)"},
    "admin_api_key": {
        "default": None,
        "help": "admin key (visible in `ps`: prefer --admin-api-key-file)",
    },
    "served_model_name": {"default": None},
    "max_running_requests": {
        "type": int,
        "default": 16,
        "help": "KV-cache slots: requests decoded together in one batch",
    },
    "context_length": {
        "type": int,
        "default": None,
        "help": "cap on prompt + output tokens (default: the model's)",
    },
    "log_level": {"default": "warning"},
    "tokenizer_worker_num": {
        "type": int,
        "default": 1,
        "help": "above 1, /abort_request passes every rid to the scheduler's prefix match",
    },
    "stream_interval": {"type": int, "default": 1, "help": "tokens per streamed chunk"},
    "incremental_streaming_output": {
        "action": "store_true",
        "help": "stream disjoint segments instead of the output so far",
    },
}
"""The SGLang ``ServerArgs`` fields ``serve`` implements, with their argparse settings (their
option strings come from ``FLAGS``)."""


def _add_serve_arguments(srv: argparse.ArgumentParser) -> None:
    options: dict[str, list[str]] = {}
    for option, (dest, _) in FLAGS.items():
        options.setdefault(dest, []).append(option)
    for dest, settings in IMPLEMENTED.items():
        names = sorted(options[dest], key=lambda o: (o != "--" + dest.replace("_", "-"), o))
        srv.add_argument(*names, dest=dest, **settings)
    srv.add_argument(
        "--logprobs",
        choices=[m.value for m in LogprobMode],
        default=None,
        help="original: log-softmax of raw logits; processed: of the temperature-scaled "
        "logits. Default: as SGLang, original only when SGLANG_RETURN_ORIGINAL_LOGPROB is "
        "1/true (unset: processed, which skews RL importance ratios)",
    )
    srv.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads for the forward (default 1: a tiny model loses to thread sync)",
    )
    for flag, env in (("--api-key-file", API_KEY_ENV), ("--admin-api-key-file", ADMIN_KEY_ENV)):
        srv.add_argument(
            flag,
            type=Path,
            default=None,
            help=f"file holding the {flag[2:-5].replace('-', ' ')} (also ${env}); keeps it "
            "off the command line, which every local user can read",
        )
    ignored = srv.add_argument_group(
        f"other SGLang {SGLANG_VERSION} flags (accepted, no effect on CPU)"
    )
    for dest, names in sorted(options.items()):
        if dest in IMPLEMENTED:
            continue
        for name in names:  # one action per option: BooleanOptionalAction pairs, aliases
            nargs = FLAGS[name][1]
            kwargs: dict[str, Any] = {"dest": _IGNORED + dest, "default": argparse.SUPPRESS}
            if nargs == 0:
                kwargs["action"] = "store_true"
            elif nargs is not None:
                kwargs["nargs"] = nargs
            ignored.add_argument(name, help=argparse.SUPPRESS, **kwargs)


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

    srv = sub.add_parser(
        "serve",
        help="serve a tinylm model over HTTP (SGLang + OpenAI routes)",
        description="Serve a tinylm model with SGLang's routes; takes SGLang's server flags.",
    )
    _add_serve_arguments(srv)
    return parser


def _key(given: str | None, path: Path | None, env: str, flag: str) -> str | None:
    if given is not None and path is not None:
        raise ConfigError(f"give {flag} or {flag}-file, not both")
    if given is not None:
        if not given:
            raise ConfigError(f"{flag} is empty")
        return given
    if path is not None:
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the key file {path}: {exc.strerror}") from exc
        if not key:
            raise ConfigError(f"the key file {path} is empty")
        return key
    return os.environ.get(env) or None


def ignored_flags(args: argparse.Namespace) -> list[str]:
    """The SGLang fields given on the command line that tinylm does not use."""
    return sorted(k[len(_IGNORED) :] for k in vars(args) if k.startswith(_IGNORED))


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
        ignored = ignored_flags(args)
        if ignored:
            print(
                "rollout tinylm: SGLang flags with no effect on tinylm: "
                + ", ".join("--" + name.replace("_", "-") for name in ignored),
                file=sys.stderr,
            )
        config = ServerConfig(
            model_dir=args.model_path,
            host=args.host,
            port=args.port,
            max_running_requests=args.max_running_requests,
            max_context=args.context_length,
            logprob_mode=None if args.logprobs is None else LogprobMode(args.logprobs),
            served_model_name=args.served_model_name,
            weight_version=args.weight_version,
            api_key=_key(args.api_key, args.api_key_file, API_KEY_ENV, "--api-key"),
            admin_api_key=_key(
                args.admin_api_key, args.admin_api_key_file, ADMIN_KEY_ENV, "--admin-api-key"
            ),
            tokenizer_worker_num=args.tokenizer_worker_num,
            stream_interval=args.stream_interval,
            incremental_streaming_output=args.incremental_streaming_output,
        )
        return serve(config, out=lambda line: print(line, flush=True))
    except ConfigError as exc:
        print(f"rollout tinylm: {exc}", file=sys.stderr)
        return 2
