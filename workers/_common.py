"""What every worker process shares: settings-backed flags, the log, signals, logging.

Flags default to ``engine.settings.Settings`` (the ``ROLLOUT_*`` environment), so a compose
file can configure a worker by environment alone and a command line can override it.

A worker's ``main`` is ``start`` (settings, flags, checks, logging, metrics) and its serving
coroutine is ``serve_actor`` (the log, the stop signal, the actor's run, the exit status), so
each worker module holds only its own flags and the actor it builds.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Protocol

from engine import metrics
from engine.errors import ConfigError, LogError, OutageExceeded
from engine.events.log import EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import open_log
from engine.settings import Settings

__all__ = [
    "Actor",
    "add_common_flags",
    "default_consumer",
    "install_stop",
    "load_settings",
    "make_log",
    "serve_actor",
    "serve_metrics",
    "setup_logging",
    "start",
]


def load_settings() -> Settings | None:
    """The environment's settings, or None after printing why they are invalid."""
    try:
        return Settings.from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None


def default_consumer(settings: Settings, role: str) -> str:
    """``ROLLOUT_WORKER_ID`` or ``<role>-<host>-<pid>``: unique per process."""
    if settings.worker_id:
        return settings.worker_id
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def add_common_flags(parser: argparse.ArgumentParser, settings: Settings, role: str) -> None:
    parser.add_argument("--redis-url", default=settings.redis_url, help="Redis holding the streams")
    parser.add_argument("--prefix", default=settings.stream_prefix, help="stream name prefix")
    parser.add_argument(
        "--worker-id",
        default=default_consumer(settings, role),
        help="consumer name in the group (a restarted process with the same id resumes "
        "its own pending entries)",
    )
    parser.add_argument("--heartbeat-ms", type=int, default=settings.heartbeat_ms)
    parser.add_argument("--claim-idle-ms", type=int, default=settings.claim_idle_ms)
    parser.add_argument("--block-ms", type=int, default=settings.block_ms)
    parser.add_argument("--max-deliveries", type=int, default=settings.max_deliveries)
    parser.add_argument("--log-level", default=settings.log_level)
    parser.add_argument(
        "--outage-limit-s", type=float, default=settings.outage_limit_s,
        help="how long to ride out an unreachable Redis before exiting with a fatal error",
    )


def check_timings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.heartbeat_ms >= args.claim_idle_ms:
        parser.error(
            f"--heartbeat-ms ({args.heartbeat_ms}) must be below --claim-idle-ms "
            f"({args.claim_idle_ms}), or live workers lose their entries to claims"
        )


QUIET_LOGGERS = ("httpx", "httpcore")
"""Libraries whose INFO lines are one per request (a worker makes thousands): they log at
WARNING unless the process runs at DEBUG."""


def setup_logging(level: str) -> None:
    level = level.upper()
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "DEBUG":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def serve_metrics(settings: Settings) -> None:
    """Serve Prometheus ``/metrics`` (``engine.metrics``) when ``ROLLOUT_METRICS_PORT`` is
    set; a port that cannot be bound ends the process with status 2, naming it."""
    if settings.metrics_port is None:
        return
    try:
        metrics.serve(settings.metrics_port, settings.metrics_host)
    except OSError as exc:
        print(
            f"error: ROLLOUT_METRICS_PORT: cannot serve /metrics on "
            f"{settings.metrics_host}:{settings.metrics_port}: {exc}",
            file=sys.stderr,
        )
        sys.exit(2)
    logging.getLogger("workers").info(
        "metrics on http://%s:%d/metrics", settings.metrics_host, settings.metrics_port
    )


def make_log(args: argparse.Namespace, producer: str) -> EventLog:
    # Credentials and TLS files come from the environment (ROLLOUT_REDIS_*), never argv.
    settings = Settings.from_env().redis(url=args.redis_url, block_ms=args.block_ms)
    return open_log(
        settings,
        names=StreamNames(args.prefix),
        producer=producer,
        max_deliveries=args.max_deliveries,
    )


def install_stop() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (a second signal exits at once)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        logging.getLogger("workers").info("signal %d: stopping", signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


Check = Callable[[argparse.ArgumentParser, argparse.Namespace], None]
"""A worker's own check of its parsed flags: calls ``parser.error`` (exit 2) on bad input."""


def start(
    build_parser: Callable[[Settings], argparse.ArgumentParser],
    argv: Sequence[str] | None,
    check: Check | None = None,
) -> tuple[Settings, argparse.Namespace] | None:
    """Settings, flags and their checks, then logging and ``/metrics``: a worker's start-up.

    None when the environment's settings are invalid (printed; the worker exits 2). Bad flags
    end the process through ``parser.error`` before logging or the metrics server start.
    """
    settings = load_settings()
    if settings is None:
        return None
    parser = build_parser(settings)
    args = parser.parse_args(argv)
    check_timings(parser, args)
    if check is not None:
        check(parser, args)
    setup_logging(args.log_level)
    serve_metrics(settings)
    return settings, args


class Actor(Protocol):
    """What ``serve_actor`` runs: an engine actor that serves until ``stop`` is set."""

    async def run(self, stop: asyncio.Event) -> None: ...


async def serve_actor(
    args: argparse.Namespace,
    build: Callable[[EventLog], Actor],
    *,
    logger: logging.Logger,
    what: str,
) -> int:
    """Open the log, build the actor on it and run it until SIGTERM or SIGINT.

    Returns the exit status: 0 after a clean stop, 1 when Redis failed (a log error, or an
    outage longer than ``--outage-limit-s``), 2 when the configuration is wrong (a URL
    without a scheme, credentials Redis refuses), logged as ``<what> <worker id>: <error>``.
    The log is closed either way; other exceptions propagate to the caller.
    """
    log: EventLog | None = None
    try:
        log = make_log(args, producer=args.worker_id)
        actor = build(log)
        stop = install_stop()
        await actor.run(stop)
    except ConfigError as exc:  # e.g. Redis refused the credentials: no retry can help
        logger.error("%s %s: %s", what, args.worker_id, exc)
        return 2
    except (LogError, OutageExceeded) as exc:
        logger.error("%s %s: %s", what, args.worker_id, exc)
        return 1
    finally:
        if log is not None:
            await log.aclose()
    return 0
