"""The capture process: teacher force-decode of kept trajectories (``engine.actors.capture``).

    rollout capture --redis-url redis://127.0.0.1:6379/0 \\
        --teacher-url http://teacher:30000 [--teacher-tokenizer DIR] [--concurrency 8]

Consumes ``CaptureRequested`` on ``rl:capture`` through the consumer group ``capture`` and
appends ``TeacherScored`` per sample; a persistent teacher failure fails the rollout
(``RolloutFailed``). The teacher is ``engine.backends.teacher.TeacherBackend``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from engine.actors.capture import BackendScorer, CaptureConfig, CaptureWorker
from engine.settings import Settings
from workers._common import add_common_flags, serve_actor, start

__all__ = ["build_parser", "main"]

logger = logging.getLogger("workers.capture")


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout capture",
        description="Force-decode kept trajectories on the teacher and record TeacherScored.",
    )
    add_common_flags(parser, settings, "capture")
    parser.add_argument(
        "--teacher-url", default=settings.teacher_url, required=settings.teacher_url is None,
        help="the teacher's SGLang server (default: ROLLOUT_TEACHER_URL)",
    )
    parser.add_argument(
        "--teacher-tokenizer", default=settings.teacher_tokenizer,
        help="teacher tokenizer folder (default: ROLLOUT_TEACHER_TOKENIZER)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="samples scored at once")
    parser.add_argument("--max-tries", type=int, default=3, help="tries per sample")
    return parser


async def _serve(args: argparse.Namespace) -> int:
    from engine.backends.teacher import TeacherBackend, TeacherConfig

    teacher = TeacherBackend(
        config=TeacherConfig(url=args.teacher_url, tokenizer_path=args.teacher_tokenizer)
    )
    config = CaptureConfig(
        consumer=args.worker_id,
        concurrency=args.concurrency,
        max_tries=args.max_tries,
        heartbeat_ms=args.heartbeat_ms,
        claim_idle_ms=args.claim_idle_ms,
        block_ms=args.block_ms,
        outage_limit_s=args.outage_limit_s,
    )
    try:
        return await serve_actor(
            args,
            lambda log: CaptureWorker(log, BackendScorer(teacher), config),
            logger=logger,
            what="capture",
        )
    finally:
        await teacher.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    started = start(build_parser, argv)
    if started is None:
        return 2
    _, args = started
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
