"""The finalizer process: append ``RolloutReady`` when rollouts are done.

Runs ``engine.actors.finalizer``:

    rollout finalizer --redis-url redis://127.0.0.1:6379/0 [--out-dir runs/]

Follows every ``RolloutRequested`` on ``rl:control`` through the consumer group
``finalizers``; several finalizers may run (only one ``RolloutReady`` is ever appended per
rollout). With ``--out-dir`` each ready rollout's summary, eval details, placement log and
samples are written to ``OUT_DIR/<rollout id>/``. Prints one line per ready rollout.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.actors.dumps import DumpConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig, RetentionConfig
from engine.events.catalog import RolloutReady
from engine.ops.retention import ACTOR_GROUPS
from engine.settings import Settings
from workers._common import add_common_flags, serve_actor, start

__all__ = ["build_parser", "main"]

logger = logging.getLogger("workers.finalizer")


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout finalizer",
        description="Decide when rollouts are ready, apply their filters, append RolloutReady.",
    )
    add_common_flags(parser, settings, "finalizer")
    parser.add_argument("--out-dir", type=Path, default=None, help="write artifacts here")
    parser.add_argument("--top-k", type=int, default=20, help="teacher top-K to ask for")
    for name, what in (("distill", "OPD discrepancy"), ("mixed", "mixed-loss"),
                       ("student", "per-iteration student")):
        parser.add_argument(
            f"--{name}-dump-dir", type=Path, default=getattr(settings, f"{name}_dump_dir"),
            help=f"write the {what} dump here (default: ROLLOUT_{name.upper()}_DUMP_DIR; off)",
        )
    parser.add_argument(
        "--retention-store", type=Path, default=settings.retention_store,
        help="run retention in this finalizer: archive finished rollouts to this directory "
        "(default ROLLOUT_RETENTION_STORE; unset: no retention here)",
    )
    parser.add_argument(
        "--retention-keep-s", type=float, default=settings.retention_keep_s,
        help="retention window (default ROLLOUT_RETENTION_KEEP_S)",
    )
    parser.add_argument(
        "--retention-every-s", type=float, default=60.0,
        help="seconds between two retention passes (default 60)",
    )
    return parser


def _print_ready(ready: RolloutReady) -> None:
    print(
        f"rollout {ready.rollout_id} ready: {len(ready.sample_ids)} kept, "
        f"{len(ready.dropped_sample_ids)} dropped, {ready.n_completed} completed, "
        f"{ready.n_aborted} aborted{' (dummy)' if ready.dummy else ''}",
        flush=True,
    )


async def _serve(args: argparse.Namespace) -> int:
    config = FinalizerConfig(
        consumer=args.worker_id,
        out_dir=args.out_dir,
        top_k=args.top_k,
        heartbeat_ms=args.heartbeat_ms,
        claim_idle_ms=args.claim_idle_ms,
        block_ms=args.block_ms,
        outage_limit_s=args.outage_limit_s,
        dumps=DumpConfig(
            distill_dir=args.distill_dump_dir,
            mixed_dir=args.mixed_dump_dir,
            student_dir=args.student_dump_dir,
        ),
        retention=(
            RetentionConfig(
                store=args.retention_store,
                keep_s=args.retention_keep_s,
                every_s=args.retention_every_s,
                groups=ACTOR_GROUPS,
            )
            if args.retention_store is not None
            else None
        ),
    )
    return await serve_actor(
        args,
        lambda log: Finalizer(log, config, on_ready=_print_ready),
        logger=logger,
        what="finalizer",
    )


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.retention_keep_s < 0:
        parser.error(f"--retention-keep-s must be >= 0, got {args.retention_keep_s}")
    if args.retention_every_s <= 0:
        parser.error(f"--retention-every-s must be > 0, got {args.retention_every_s}")


def main(argv: Sequence[str] | None = None) -> int:
    started = start(build_parser, argv, _check)
    if started is None:
        return 2
    _, args = started
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
