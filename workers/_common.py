"""What every worker process shares: its flags, the log, signals, logging.

A worker's flags are generated from its settings (``engine.settings.Flags``) and default to the
``ROLLOUT_*`` environment, so a compose file can configure a worker by environment alone and a
command line can override it.

A worker's ``main`` is ``start`` (settings, flags, logging, metrics) and its serving coroutine
is ``serve_actor`` (the log, the stop signal, the actor's run, the exit status), so each worker
module holds only the settings it takes and the actor it builds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from engine import metrics
from engine.errors import ConfigError, LogError, OutageExceeded
from engine.events.log import EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import open_log
from engine.projections.control import ControlState
from engine.runtime.follower import Follower, FollowerClosed
from engine.settings import Flags, Settings

__all__ = [
    "Actor",
    "consumer_name",
    "follow_servers",
    "install_stop",
    "make_log",
    "serve_actor",
    "serve_metrics",
    "servers_from_log",
    "settings_parser",
    "setup_logging",
    "start",
]


def consumer_name(settings: Settings, role: str) -> str:
    """``ROLLOUT_WORKER_ID`` or ``<role>-<host>-<pid>``: unique per process."""
    if settings.worker_id:
        return settings.worker_id
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def settings_parser(
    prog: str, description: str, flags: Flags, settings: Settings
) -> argparse.ArgumentParser:
    """A worker's parser: one flag per setting it takes, defaults from ``settings``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"{description} Every flag defaults to its ROLLOUT_* variable.",
    )
    flags.add_to(parser, settings)
    return parser


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


def make_log(settings: Settings, producer: str) -> EventLog:
    return open_log(
        settings.redis(),
        names=StreamNames(settings.stream_prefix),
        producer=producer,
        max_deliveries=settings.max_deliveries,
    )


def servers_from_log(settings: Settings) -> bool:
    """Whether the policy servers are those registered on ``rl:control`` (``ConfigError`` when
    ``--sglang-url`` names them too)."""
    if settings.servers_from_log and settings.sglang_url:
        raise ConfigError(
            "ROLLOUT_SERVERS_FROM_LOG and --sglang-url both name the policy servers: set one"
        )
    return settings.servers_from_log


@contextlib.asynccontextmanager
async def follow_servers(
    control: Follower[ControlState],
    use: Callable[[tuple[str, ...]], None],
    *,
    outage_limit_s: float | None,
    use_eval: Callable[[tuple[str, ...]], None] | None = None,
) -> AsyncIterator[None]:
    """Hand ``use`` the policy servers registered on ``control``'s stream, then again on every
    change of them, while the body runs (and ``use_eval`` the eval servers, likewise). The
    first policy registration is waited for up to the outage limit (``ConfigError`` when none
    comes)."""
    try:
        await control.wait_for(
            lambda state: bool(state.registered_servers()), outage_limit_s,
            what="waiting for a policy server to be registered",
        )
    except TimeoutError as exc:
        raise ConfigError(
            f"no policy server registered on {control.log.names.prefix}:control within "
            f"{outage_limit_s:g}s: "
            "is `rollout serve` running?"
        ) from exc
    servers = control.state.registered_servers()
    logging.getLogger("workers").info("policy servers from the log: %s", ", ".join(servers))
    use(servers)
    evals = control.state.registered_servers("eval")
    if use_eval is not None:
        use_eval(evals)

    async def follow() -> None:
        nonlocal servers, evals
        seen = control.version
        while True:
            try:
                await control.changed(seen)
            except FollowerClosed:
                return
            seen = control.version
            now = control.state.registered_servers()
            if now != servers:
                logging.getLogger("workers").info(
                    "policy servers from the log: %s", ", ".join(now) or "none"
                )
                servers = now
                use(now)
            now = control.state.registered_servers("eval")
            if use_eval is not None and now != evals:
                logging.getLogger("workers").info(
                    "eval servers from the log: %s", ", ".join(now) or "none"
                )
                evals = now
                use_eval(now)

    task = asyncio.create_task(follow())
    try:
        yield
    finally:
        control.close()  # ends the follow after its current read (a read is never cancelled)
        await asyncio.gather(task, return_exceptions=True)


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


def start(
    flags: Flags,
    build_parser: Callable[[Settings], argparse.ArgumentParser],
    argv: Sequence[str] | None,
) -> tuple[Settings, argparse.Namespace] | None:
    """Settings from the environment and the flags, then logging and ``/metrics``.

    None when the environment's settings are invalid (printed; the worker exits 2). Bad flags
    end the process through ``parser.error`` (exit 2) before logging or the metrics server
    start. The namespace holds the parsed flags under the settings' names, for the evaluator
    config's ``args``.
    """
    try:
        settings = Settings.from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    parser = build_parser(settings)
    args = parser.parse_args(argv)
    try:
        settings = flags.apply(settings, args)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging(settings.log_level)
    serve_metrics(settings)
    return settings, args


class Actor(Protocol):
    """What ``serve_actor`` runs: an engine actor that serves until ``stop`` is set."""

    async def run(self, stop: asyncio.Event) -> None: ...


async def serve_actor(
    settings: Settings,
    consumer: str,
    build: Callable[[EventLog], Actor],
    *,
    logger: logging.Logger,
    what: str,
) -> int:
    """Open the log, build the actor on it and run it until SIGTERM or SIGINT.

    Returns the exit status: 0 after a clean stop, 1 when Redis failed (a log error, or an
    outage longer than ``--outage-limit-s``), 2 when the configuration is wrong (a URL
    without a scheme, credentials Redis refuses), logged as ``<what> <consumer>: <error>``.
    The log is closed either way; other exceptions propagate to the caller.
    """
    log: EventLog | None = None
    try:
        log = make_log(settings, producer=consumer)
        actor = build(log)
        stop = install_stop()
        await actor.run(stop)
    except ConfigError as exc:  # e.g. Redis refused the credentials: no retry can help
        logger.error("%s %s: %s", what, consumer, exc)
        return 2
    except (LogError, OutageExceeded) as exc:
        logger.error("%s %s: %s", what, consumer, exc)
        return 1
    finally:
        if log is not None:
            await log.aclose()
    return 0
