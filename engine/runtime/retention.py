"""Retention: keep Redis memory bounded while rollouts keep coming.

One pass (``retention_pass``), run by the finalizer every ``--retention-every-s`` seconds
when it has a ``--retention-store`` (no operator command needed), or by ``rollout retention``
once or every ``--every`` seconds. It lives in the runtime so a long-running actor can run
it; ``engine.ops.retention`` binds it to the actors' consumer groups.


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

* **The pool** (``rl:pool``): the pass folds it from its snapshot (``PoolProjection`` is
  snapshottable) and stores a new snapshot at the stream's end, then trims the entries
  below the *previous* pass's snapshot (and inside the window, none). Every reader of the
  pool (the scheduler, evaluator workers, ``rollout pool``, ``rollout top``) starts from
  the snapshot and folds the tail, so what is trimmed is never needed; trimming one pass
  behind leaves a reader that loaded the previous snapshot a whole pass interval to read
  its tail. With ``AdmissionClosed`` the snapshot itself holds only live batches (and one
  id per closed rollout), so the pool's memory stays flat.

``rl:data`` and ``rl:dead`` are not touched: the scheduler folds the first from the start
(one small event per rollout), and dead letters wait for an operator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import DecodeError
from engine.events.catalog import RolloutFailed, RolloutReady
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID, format_id, id_after, id_ms, parse_id
from engine.events.log import EventLog, RawEntry
from engine.projections.placement import PoolProjection
from engine.runtime.archive import Archive, read_archive, write_archive
from engine.runtime.rebuild import load_snapshot, rebuild, save_snapshot

__all__ = [
    "ARCHIVE_SUFFIX",
    "RetentionGroups",
    "RetentionReport",
    "archive_path",
    "retention_pass",
]

ARCHIVE_SUFFIX = ".rollout"


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


async def _snapshot_and_trim_pool(log: EventLog, before: str) -> int | None:
    """Snapshot ``rl:pool`` at its end; trim below the previous snapshot and ``before``.
    None when the pool stream is empty (nothing to do)."""
    stream = log.names.pool
    if not await log.stream_length(stream):
        return None
    projection = PoolProjection()
    previous = await load_snapshot(log, projection)
    current = await rebuild(log, stream, projection, since=previous)
    if previous is None or current.position != previous.position:
        await save_snapshot(log, projection, current)
    if previous is None or previous.position == EMPTY_ID:
        return 0
    keep_from = min(parse_id(id_after(previous.position)), parse_id(before))
    return await log.trim_before(stream, format_id(*keep_from))


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
    pool_trimmed = await _snapshot_and_trim_pool(log, before)
    if pool_trimmed is not None:
        report.trimmed[names.pool] = pool_trimmed
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
