"""Retention: keep Redis memory bounded while rollouts keep coming.

One pass (``retention_pass``), run by the finalizer every ``--retention-every-s`` seconds
(on by default, archiving to ``--retention-store``, else ``<--work-dir>/archive``; no
operator command needed), or by ``rollout retention`` once or every ``--every`` seconds. It
lives in the runtime so a long-running actor can run it; ``engine.ops.retention`` binds it
to the actors' consumer groups.


* **Shared streams** read through consumer groups (``rl:control``, ``rl:capture`` and every
  ``rl:work:{evaluator}``) are trimmed below what every group has acked
  (``EventLog.trim_acked``): an entry some group has pending or not yet been delivered is
  never trimmed. Entries younger than the retention window are kept too, so a trainer that
  waits for its ``RolloutReady`` on ``rl:control`` a little late still finds it. A stream
  whose readers' groups do not all exist yet (a finalizer that never started) is not
  trimmed: such a group reads the stream from its start once it is created.
* **Finished rollouts**: a rollout stream whose ``RolloutReady`` or ``RolloutFailed`` is older
  than the window is written to the file store as ``<store>/<rollout id>.rollout`` in the
  ``rollout archive`` format (``engine/ops/replay.py``), read back and compared entry by
  entry, and only then deleted from Redis. ``rollout replay ID --from FILE`` rebuilds its
  artifacts byte-identically from that file. A stream with no terminal event is left alone,
  and so is a stream whose archive already exists with different content (a late write
  after the archive; an operator decides). A finished rollout is also kept while an entry
  left in a shared stream after the trim still names it: work a worker has not acked yet (a
  failed rollout's queued batches, say) still folds the rollout stream when it runs.

* **The pool** (``rl:pool``) and **the data cursor** (``rl:data``): the pass folds each
  from its snapshot (``PoolProjection`` and ``DataCursorProjection`` are snapshottable) and
  stores a new snapshot at the stream's end, then trims the entries below the *previous*
  pass's snapshot (and inside the window, none). Every reader of these streams (the
  scheduler, evaluator workers, ``rollout pool``, ``rollout top``) starts from the snapshot
  and folds the tail, so what is trimmed is never needed; trimming one pass behind leaves a
  reader that loaded the previous snapshot a whole pass interval to read its tail. With
  ``AdmissionClosed`` the pool's snapshot itself holds only live batches (and one id per
  closed rollout), so the pool's memory stays flat.
* **Dead letters** (``rl:dead``): the oldest letters beyond ``dead_max`` are trimmed. A
  letter's mark in the seen-set (``rl:dead:seen``) only stops a second copy of it; a mark
  goes once its letter is trimmed and the entry it names is gone from its stream (trimmed,
  or the stream deleted), when no reader can find that entry again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.errors import DecodeError
from engine.events.catalog import DeadLetter, RolloutFailed, RolloutReady
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID, format_id, id_after, id_ms, parse_id
from engine.events.log import EventLog, RawEntry
from engine.projections.base import Projection, Snapshottable
from engine.projections.data_cursor import DataCursorProjection
from engine.projections.placement import PoolProjection
from engine.runtime.archive import Archive, read_archive, write_archive
from engine.runtime.rebuild import load_snapshot, rebuild, save_snapshot

__all__ = [
    "ARCHIVE_SUFFIX",
    "DEAD_MAX",
    "RetentionGroups",
    "RetentionReport",
    "archive_path",
    "retention_pass",
]

ARCHIVE_SUFFIX = ".rollout"
DEAD_MAX = 10_000
"""Dead letters ``rl:dead`` keeps by default (``ROLLOUT_RETENTION_DEAD_MAX``)."""


@dataclass(slots=True)
class RetentionReport:
    """What one pass did."""

    trimmed: dict[str, int] = field(default_factory=dict)  # stream -> entries trimmed
    archived: list[str] = field(default_factory=list)  # rollout ids archived and deleted
    kept: list[str] = field(default_factory=list)  # finished, but inside the window
    conflicts: list[str] = field(default_factory=list)  # archive exists and differs
    waiting: list[str] = field(default_factory=list)  # finished, but still referred to

    def summary(self) -> str:
        return (
            f"trimmed {sum(self.trimmed.values())} entries of {len(self.trimmed)} streams; "
            f"archived and deleted {len(self.archived)} rollouts; "
            f"{len(self.kept)} finished rollouts inside the window; "
            f"{len(self.waiting)} still referred to by shared-stream entries; "
            f"{len(self.conflicts)} archive conflicts"
        )


def archive_path(store: Path, rollout_id: str) -> Path:
    return store / f"{rollout_id}{ARCHIVE_SUFFIX}"


def _finished_at(entries: list[RawEntry]) -> str | None:
    """The id of the rollout stream's first ``RolloutReady`` / ``RolloutFailed``, or None."""
    for entry_id, raw in reversed(entries):  # the terminal event is at or near the end
        try:
            ev = decode(raw)
        except DecodeError:
            continue
        if isinstance(ev, RolloutReady | RolloutFailed):
            return entry_id
    return None


async def _archive_and_delete(
    log: EventLog, store: Path, rollout_id: str, stream: str, entries: list[RawEntry]
) -> bool:
    """Write (or find) the archive, verify it against ``entries``, delete the stream."""
    path = archive_path(store, rollout_id)
    if not path.exists():
        write_archive(path, Archive(stream, rollout_id, entries))
    stored = read_archive(path)
    if stored.stream != stream or stored.entries != entries:
        return False
    # The stream may have grown since it was read (a late write): delete only what was
    # archived, i.e. nothing if a later entry exists.
    if await log.stream_length(stream) != len(entries):
        return False
    return await log.delete_stream(stream)


class _Snapshotted(Projection[Any], Snapshottable[Any], Protocol):
    """A fold of a stream that readers start from a stored snapshot of."""


async def _snapshot_and_trim(
    log: EventLog, stream: str, projection: _Snapshotted, before: str
) -> int | None:
    """Snapshot ``stream`` at its end; trim below the previous snapshot and ``before``.
    None when the stream is empty (nothing to do)."""
    if not await log.stream_length(stream):
        return None
    previous = await load_snapshot(log, projection)
    current = await rebuild(log, stream, projection, since=previous)
    if previous is None or current.position != previous.position:
        await save_snapshot(log, projection, current)
    if previous is None or previous.position == EMPTY_ID:
        return 0
    keep_from = min(parse_id(id_after(previous.position)), parse_id(before))
    return await log.trim_before(stream, format_id(*keep_from))


async def _trim_dead(log: EventLog, dead_max: int) -> int:
    """Trim the oldest dead letters beyond ``dead_max``, then forget the seen-set marks
    whose letter is trimmed and whose entry is gone from its stream (module docstring)."""
    dead = log.names.dead
    excess = await log.stream_length(dead) - dead_max
    trimmed = 0
    if excess > 0:
        oldest = await log.read_raw(dead, limit=excess)
        trimmed = await log.trim_before(dead, id_after(oldest[-1][0]))
    gone: set[str] = set()
    first: dict[str, str] = {}
    for mark in await log.dead_marks():
        stream, _, entry_id = mark.rpartition("@")
        if stream not in first:
            first[stream] = await log.first_id(stream)
        if first[stream] == EMPTY_ID or parse_id(entry_id) < parse_id(first[stream]):
            gone.add(mark)
    if gone:  # only then are the letters read: those still kept keep their marks
        for env in await log.read_all(dead):
            if isinstance(env.event, DeadLetter):
                gone.discard(f"{env.event.source_stream}@{env.event.source_id}")
        await log.forget_dead_marks(gone)
    return trimmed


@dataclass(frozen=True, slots=True)
class RetentionGroups:
    """The consumer groups that read each shared stream: an entry is trimmed only once
    every one of them has acked it (the actors' group names; ``engine.ops.retention``
    and the finalizer's entry point pass the real ones)."""

    control: tuple[str, ...]
    capture: tuple[str, ...]
    work: tuple[str, ...]


async def retention_pass(
    log: EventLog,
    store: Path,
    *,
    keep_s: float,
    groups: RetentionGroups,
    dead_max: int = DEAD_MAX,
    now_s: float | None = None,
) -> RetentionReport:
    """One retention pass (see the module docstring)."""
    report = RetentionReport()
    now = time.time() if now_s is None else now_s
    horizon_ms = max(0, int((now - keep_s) * 1000))
    before = format_id(horizon_ms, 0)
    names = log.names
    work = await log.list_streams(names.work_pattern)
    shared: list[tuple[str, tuple[str, ...]]] = [
        (names.control, groups.control),
        (names.capture, groups.capture),
        *((stream, groups.work) for stream in work),
    ]
    snapshotted: list[tuple[str, _Snapshotted]] = [
        (names.pool, PoolProjection()), (names.data, DataCursorProjection()),
    ]
    for stream, projection in snapshotted:
        trimmed = await _snapshot_and_trim(log, stream, projection, before)
        if trimmed is not None:
            report.trimmed[stream] = trimmed
    report.trimmed[names.dead] = await _trim_dead(log, dead_max)
    busy: set[str] = set()  # rollouts some shared-stream entry still refers to
    for stream, readers in shared:
        if not await log.stream_length(stream):
            continue
        report.trimmed[stream] = await log.trim_acked(stream, before=before, require=readers)
        for env in await log.read_all(stream):
            rollout_id = getattr(env.event, "rollout_id", None)
            if isinstance(rollout_id, str):
                busy.add(rollout_id)
    store.mkdir(parents=True, exist_ok=True)
    for stream in await log.list_streams(names.rollout_pattern):
        rollout_id = names.rollout_id_of(stream)
        if rollout_id is None:
            continue
        entries = await log.read_raw(stream)
        finished = _finished_at(entries)
        if finished is None:
            continue
        if id_ms(finished) >= horizon_ms:
            report.kept.append(rollout_id)
        elif rollout_id in busy:
            report.waiting.append(rollout_id)
        elif await _archive_and_delete(log, store, rollout_id, stream, entries):
            report.archived.append(rollout_id)
        else:
            report.conflicts.append(rollout_id)
    return report
