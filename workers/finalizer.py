"""The finalizer process: append ``RolloutReady`` when rollouts are done.

Runs ``engine.actors.finalizer``:

    rollout finalizer --redis-url redis://127.0.0.1:6379/0 [--out-dir runs/]

Follows every ``RolloutRequested`` on ``rl:control`` through the consumer group
``finalizers``; several finalizers may run (only one ``RolloutReady`` is ever appended per
rollout). With ``--out-dir`` each ready rollout's summary, eval details, placement log and
samples are written to ``OUT_DIR/<rollout id>/``. Unless ``--no-retention``, finished
rollouts are archived to ``--retention-store`` (default ``<--work-dir>/archive``) and deleted
after ``--retention-keep-s``, and the shared streams are trimmed. A rollout whose stream
stays still for ``--stall-window-s`` gets a ``RolloutStalled``. Prints one line per ready
rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from engine.actors.dumps import DumpConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig, RetentionConfig
from engine.events.catalog import RolloutReady
from engine.ops.retention import ACTOR_GROUPS
from engine.settings import PROCESS, Flags, Settings
from workers._common import consumer_name, serve_actor, settings_parser, start

__all__ = ["FLAGS", "build_parser", "main"]

logger = logging.getLogger("workers.finalizer")

FLAGS = Flags((
    *PROCESS, "max_deliveries", "out_dir", "teacher_top_k", "distill_dump_dir",
    "mixed_dump_dir", "student_dump_dir", "stall_window_s", "work_dir", "retention",
    "retention_store", "retention_keep_s", "retention_every_s", "retention_dead_max",
))


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    return settings_parser(
        "rollout finalizer",
        "Decide when rollouts are ready, apply their filters, append RolloutReady.",
        FLAGS,
        settings,
    )


def _print_ready(ready: RolloutReady) -> None:
    print(
        f"rollout {ready.rollout_id} ready: {len(ready.sample_ids)} kept, "
        f"{len(ready.dropped_sample_ids)} dropped, {ready.n_completed} completed, "
        f"{ready.n_aborted} aborted{' (dummy)' if ready.dummy else ''}",
        flush=True,
    )


def _config(settings: Settings, consumer: str) -> FinalizerConfig:
    retention = None
    if settings.retention:
        retention = RetentionConfig(
            store=settings.archive_dir(),
            keep_s=settings.retention_keep_s,
            every_s=settings.retention_every_s,
            groups=ACTOR_GROUPS,
            dead_max=settings.retention_dead_max,
        )
    return FinalizerConfig(
        consumer=consumer,
        out_dir=settings.out_dir,
        top_k=settings.teacher_top_k,
        heartbeat_ms=settings.heartbeat_ms,
        claim_idle_ms=settings.claim_idle_ms,
        block_ms=settings.block_ms,
        outage_limit_s=settings.outage_limit_s,
        dumps=DumpConfig(
            distill_dir=settings.distill_dump_dir,
            mixed_dir=settings.mixed_dump_dir,
            student_dir=settings.student_dump_dir,
        ),
        retention=retention,
        stall_window_s=settings.stall_window_s or None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    started = start(FLAGS, build_parser, argv)
    if started is None:
        return 2
    settings, _ = started
    consumer = consumer_name(settings, "finalizer")
    config = _config(settings, consumer)
    return asyncio.run(
        serve_actor(
            settings,
            consumer,
            lambda log: Finalizer(log, config, on_ready=_print_ready),
            logger=logger,
            what="finalizer",
        )
    )


if __name__ == "__main__":
    sys.exit(main())
