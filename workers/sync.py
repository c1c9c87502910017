"""The weight syncer process: load published policy versions on every model server.

Runs ``engine.actors.weight_sync``:

    rollout sync --redis-url redis://127.0.0.1:6379/0 --sglang-url http://gpu0:30000,http://gpu1:30000

Follows ``PolicyVersionPublished`` on ``rl:control`` through the consumer group ``sync``:
quiesces the engine (schedulers stop admitting, workers park at turn boundaries), posts
``/update_weights_from_disk`` to every ``--sglang-url`` (the same servers the workers use;
default ``ROLLOUT_SGLANG_URL``), checks each reports the version, and records
``PolicyVersionActivated`` or ``WeightSyncFailed`` (which stops generation until a later sync
succeeds). With ``ROLLOUT_SERVERS_FROM_LOG`` the servers are those ``rollout serve``
registered on ``rl:control`` when the weights are loaded, and a server registered later is
brought to the active version. Several syncers may run: one sync is open at a time, and a
syncer that dies mid-sync is replaced by another that resumes it. The servers' admin key is
read from ``ROLLOUT_SGLANG_ADMIN_KEY_FILE`` (never from the command line). Prints one line per
outcome. Exit status 2: bad settings; 1: Redis failed while serving.
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
from engine.settings import PROCESS, Flags, Settings
from workers._common import consumer_name, serve_actor, servers_from_log, settings_parser, start

__all__ = ["FLAGS", "build_parser", "main"]

logger = logging.getLogger("workers.sync")

FLAGS = Flags((*PROCESS, "max_deliveries", "sglang_url", "servers_from_log", "park_timeout_s",
               "live_window_ms", "sync_interrupt", "grace_s"))


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    return settings_parser(
        "rollout sync",
        "Load published policy versions on every model server, between turns.",
        FLAGS,
        settings,
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = start(FLAGS, build_parser, argv)
    if started is None:
        return 2
    settings, _ = started
    consumer = consumer_name(settings, "sync")
    try:
        config = SyncConfig(
            syncer_id=consumer,
            servers=parse_urls(settings.sglang_url),
            servers_from_log=servers_from_log(settings),
            admin_key=settings.admin_key(),
            park_timeout_s=settings.park_timeout_s,
            live_window_ms=settings.live_window_ms,
            interrupt=settings.sync_interrupt,
            heartbeat_ms=settings.heartbeat_ms,
            claim_idle_ms=settings.claim_idle_ms,
            block_ms=settings.block_ms,
            grace_s=settings.grace_s,
            outage_limit_s=settings.outage_limit_s,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logger.info("syncer %s: servers %s", consumer,
                ", ".join(config.servers) or "those registered on rl:control")
    return asyncio.run(
        serve_actor(settings, consumer, lambda log: WeightSyncer(log, config), logger=logger,
                    what="syncer")
    )


if __name__ == "__main__":
    sys.exit(main())
