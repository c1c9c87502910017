"""Retention for operators: ``rollout retention`` runs :func:`retention_pass` over the
actors' consumer groups. The pass itself (trim acked shared streams, archive and delete
finished rollouts, snapshot and trim the pool and the data cursor, trim dead letters and
their seen-set) is :mod:`engine.runtime.retention`, which the finalizer also runs on its
own, by default (see docs/operations.md)."""

from __future__ import annotations

from pathlib import Path

from engine.actors.capture import GROUP as CAPTURE_GROUP
from engine.actors.evaluator_worker import GROUP as EVALUATOR_GROUP
from engine.actors.finalizer import GROUP as FINALIZER_GROUP
from engine.actors.scheduler import SCHEDULER_GROUP
from engine.events.log import EventLog
from engine.runtime import retention as _retention
from engine.runtime.retention import (
    ARCHIVE_SUFFIX,
    DEAD_MAX,
    RetentionGroups,
    RetentionReport,
    archive_path,
)

__all__ = [
    "ACTOR_GROUPS",
    "ARCHIVE_SUFFIX",
    "RetentionReport",
    "archive_path",
    "retention_pass",
]

ACTOR_GROUPS = RetentionGroups(
    control=(SCHEDULER_GROUP, FINALIZER_GROUP),
    capture=(CAPTURE_GROUP,),
    work=(EVALUATOR_GROUP,),
)


async def retention_pass(
    log: EventLog,
    store: Path,
    *,
    keep_s: float,
    dead_max: int = DEAD_MAX,
    now_s: float | None = None,
) -> RetentionReport:
    """One retention pass over the actors' groups (``engine.runtime.retention``)."""
    return await _retention.retention_pass(
        log, store, keep_s=keep_s, groups=ACTOR_GROUPS, dead_max=dead_max, now_s=now_s
    )
