"""The model-server supervisor process: ``engine.ops.serve``.

    rollout serve --backend tinylm --model DIR --count 2 -- --max-running-requests 8

Starts ``--count`` servers on reserved ports at the active policy version, restarts one that
exits (capped backoff) and registers them on ``rl:control``; SIGTERM stops and retires them.
``--role eval --model DIR --weight-version V`` runs eval servers instead: kept at version V
(the syncer never loads them), they serve the eval rollouts pinned to V.
Server arguments come from ``ROLLOUT_SERVE_ARGS`` and after ``--``; one SGLang's
``ServerArgs`` lacks is refused before anything starts. Exit status 2: bad settings or server
arguments; 1: Redis failed or a server did not come up.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from engine.errors import BackendUnavailable, ConfigError
from engine.ops.processes import Processes
from engine.ops.serve import ServeConfig, Supervisor, check_role, check_server_args
from engine.settings import PROCESS, Flags, Settings
from workers._common import consumer_name, serve_actor, settings_parser, start
from workers.cli import ROLLOUT

__all__ = ["FLAGS", "build_parser", "main"]

logger = logging.getLogger("workers.serve")

FLAGS = Flags(
    (
        *PROCESS,
        "serve_backend",
        "model_dir",
        "serve_count",
        "serve_role",
        "serve_weight_version",
        "serve_host",
        "serve_port",
        "serve_args",
        "serve_backoff_s",
        "serve_backoff_max_s",
        "serve_log_dir",
        "grace_s",
    ),
    aliases={
        "serve_backend": "--backend",
        "model_dir": "--model",
        "serve_count": "--count",
        "serve_role": "--role",
        "serve_weight_version": "--weight-version",
        "serve_host": "--host",
        "serve_port": "--port",
    },
)


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = settings_parser(
        "rollout serve",
        "Run model servers at the active policy version and register them on rl:control.",
        FLAGS,
        settings,
    )
    parser.usage = "rollout serve [FLAGS] [-- SERVER-ARGS...]"
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    cut = words.index("--") if "--" in words else len(words)
    started = start(FLAGS, build_parser, words[:cut])
    if started is None:
        return 2
    settings, _ = started
    consumer = consumer_name(settings, "serve")
    server_args = (*shlex.split(settings.serve_args or ""), *words[cut + 1 :])
    try:
        if settings.model_dir is None:
            raise ConfigError("--model (ROLLOUT_MODEL_DIR) is required: the base model folder")
        check_server_args(server_args, settings.serve_backend)
        check_role(settings.serve_role, settings.serve_weight_version)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logs = settings.serve_log_dir or Path(tempfile.mkdtemp(prefix="rollout-serve-"))
    logger.info("supervisor %s: server logs in %s", consumer, logs)
    config = ServeConfig(
        backend=settings.serve_backend,
        model=settings.model_dir,
        count=settings.serve_count,
        role=settings.serve_role,
        supervisor=consumer,
        weight_version=settings.serve_weight_version,
        host=settings.serve_host,
        port=settings.serve_port,
        args=server_args,
        backoff_s=settings.serve_backoff_s,
        backoff_max_s=settings.serve_backoff_max_s,
    )
    processes = Processes(logs, rollout=ROLLOUT, grace_s=settings.grace_s)
    try:
        return asyncio.run(
            serve_actor(
                settings,
                consumer,
                lambda log: Supervisor(log, processes, config),
                logger=logger,
                what="supervisor",
            )
        )
    except BackendUnavailable as exc:
        logger.error("supervisor %s: %s", consumer, exc)
        return 1
    finally:
        processes.stop()


if __name__ == "__main__":
    sys.exit(main())
