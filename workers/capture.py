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
from engine.settings import PROCESS, Flags, Settings
from workers._common import consumer_name, serve_actor, settings_parser, start

__all__ = ["FLAGS", "build_parser", "main"]

logger = logging.getLogger("workers.capture")

FLAGS = Flags((
    *PROCESS, "max_deliveries", "teacher_url", "teacher_tokenizer", "capture_concurrency",
    "capture_max_tries",
))


def build_parser(settings: Settings) -> argparse.ArgumentParser:
    return settings_parser(
        "rollout capture",
        "Force-decode kept trajectories on the teacher and record TeacherScored.",
        FLAGS,
        settings,
    )


async def _serve(settings: Settings, teacher_url: str) -> int:
    from engine.backends.teacher import TeacherBackend, TeacherConfig

    teacher = TeacherBackend(
        config=TeacherConfig(url=teacher_url, tokenizer_path=settings.teacher_tokenizer)
    )
    consumer = consumer_name(settings, "capture")
    config = CaptureConfig(
        consumer=consumer,
        concurrency=settings.capture_concurrency,
        max_tries=settings.capture_max_tries,
        heartbeat_ms=settings.heartbeat_ms,
        claim_idle_ms=settings.claim_idle_ms,
        block_ms=settings.block_ms,
        outage_limit_s=settings.outage_limit_s,
    )
    try:
        return await serve_actor(
            settings,
            consumer,
            lambda log: CaptureWorker(log, BackendScorer(teacher), config),
            logger=logger,
            what="capture",
        )
    finally:
        await teacher.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    started = start(FLAGS, build_parser, argv)
    if started is None:
        return 2
    settings, _ = started
    if settings.teacher_url is None:
        print("error: --teacher-url (or ROLLOUT_TEACHER_URL) is required", file=sys.stderr)
        return 2
    return asyncio.run(_serve(settings, settings.teacher_url))


if __name__ == "__main__":
    sys.exit(main())
