"""The weight syncer process: load published policy versions on every model server.

Runs ``engine.actors.weight_sync``:

    rollout sync --redis-url redis://127.0.0.1:6379/0 --sglang-url http://gpu0:30000,http://gpu1:30000

Follows ``PolicyVersionPublished`` on ``rl:control`` through the consumer group ``sync``:
quiesces the engine (schedulers stop admitting, workers park at turn boundaries), posts
``/update_weights_from_disk`` to every ``--sglang-url`` (the same servers the workers use;
default ``ROLLOUT_SGLANG_URL``), checks each reports the version, and records
``PolicyVersionActivated`` or ``WeightSyncFailed`` (which stops generation until a later sync
succeeds). Several syncers may run: one sync is open at a time, and a syncer that dies
mid-sync is replaced by another that resumes it. The servers' admin key is read from
``ROLLOUT_SGLANG_ADMIN_KEY_FILE`` (never from the command line). Prints one line per outcome.
Exit status 2: bad settings; 1: Redis failed while serving.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from engine.actors.weight_sync import SyncConfig, WeightSyncer
from engine.backends.pool import parse_urls
from engine.errors import ConfigError
from engine.settings import Settings
from workers._common import add_common_flags, serve_actor, start

__all__ = ["build_parser", "main"]

logger = logging.getLogger("workers.sync")


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout sync",
        description="Load published policy versions on every model server, between turns.",
    )
    add_common_flags(parser, settings, "sync")
    add = parser.add_argument
    add(
        "--sglang-url", action="append", default=None,
        help="model servers to load the weights on: the workers' --sglang-url (repeat it or "
        "separate URLs with commas; default: ROLLOUT_SGLANG_URL)",
    )
    add(
        "--park-timeout-s", type=float, default=120.0,
        help="how long to wait for live workers to park before loading anyway",
    )
    add(
        "--live-window-ms", type=int, default=None,
        help="a worker silent on its work streams for longer is not waited for "
        "(default: --claim-idle-ms)",
    )
    add("--grace-s", type=float, default=30.0, help="time a running sync gets on SIGTERM")
    return parser


def admin_key(settings: Settings) -> str | None:
    """The admin key from ``ROLLOUT_SGLANG_ADMIN_KEY_FILE``; ``ConfigError`` naming the file."""
    path = settings.sglang_admin_key_file
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(
            f"ROLLOUT_SGLANG_ADMIN_KEY_FILE: cannot read {path}: {exc.strerror}"
        ) from exc
    if not key:
        raise ConfigError(f"ROLLOUT_SGLANG_ADMIN_KEY_FILE: {path} is empty")
    return key


async def _serve(args: argparse.Namespace, config: SyncConfig) -> int:
    logger.info("syncer %s: servers %s", args.worker_id, ", ".join(config.servers))
    return await serve_actor(
        args, lambda log: WeightSyncer(log, config), logger=logger, what="syncer"
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = start(build_parser, argv)
    if started is None:
        return 2
    settings, args = started
    try:
        config = SyncConfig(
            syncer_id=args.worker_id,
            servers=parse_urls(args.sglang_url or settings.sglang_url),
            admin_key=admin_key(settings),
            park_timeout_s=args.park_timeout_s,
            live_window_ms=args.live_window_ms,
            heartbeat_ms=args.heartbeat_ms,
            claim_idle_ms=args.claim_idle_ms,
            block_ms=args.block_ms,
            grace_s=args.grace_s,
            outage_limit_s=args.outage_limit_s,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, config))


if __name__ == "__main__":
    sys.exit(main())
