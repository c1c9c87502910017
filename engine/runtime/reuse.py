"""Reusing stored rollouts instead of generating new ones.

A stored rollout is a ready rollout on the log (named by its id) or an archive file (written by
``rollout archive`` or the retention loop). :func:`reuse_rollout` makes a new rollout of it:

* the new rollout's stream is written in one atomic compare-and-append on an empty stream: a
  ``RolloutReused`` first (the source, the SHA-256 of its raw entries, the iteration), then the
  source's events in their order, decoded and written in the current schema;
* then the source's ``RolloutReady`` is copied to ``rl:control`` under the new id and
  iteration, once (a marker), so ``wait_ready``, ``load``, ``iter_load``, ``rollout replay``
  and retention treat the new rollout as any other. Nothing is generated: no
  ``RolloutRequested`` reaches ``rl:control``, so no scheduler or worker sees it.

The copy makes the new rollout self-contained (the source may be trimmed, the archive moved)
and its replay says where its data came from. Calling it again with the same rollout id and
source finishes what a crash between the two steps left; the same id with another source is
refused. A source that is not ready (no ``RolloutReady``) is refused, naming it.

:func:`load_archive` builds the trainer's samples straight from an archive file, without a
log. :func:`reuse_source` picks the stored rollout an iteration reuses: one per iteration in
order, or the first one for every iteration (multi-epoch SFT on iteration 0's data).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

from engine.errors import AppendConflict, ConfigError, DecodeError, RolloutError
from engine.events.base import Event
from engine.events.catalog import RolloutReady, RolloutReused
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID
from engine.events.log import EventLog, RawEntry
from engine.projections.samples import trainer_samples
from engine.runtime.archive import read_archive
from engine.runtime.readback import StreamLoad
from engine.sample import Sample

__all__ = ["archive_files", "load_archive", "reuse_rollout", "reuse_source"]


def load_archive(path: str | os.PathLike[str]) -> list[Sample]:
    """The trainer's samples of the rollout archived in ``path``, as ``load`` builds them from
    its stream; an archive without a ``RolloutReady`` raises ``RolloutError`` naming it."""
    archive = read_archive(path)
    load = StreamLoad(archive.stream, keep=True)
    load.feed(archive.entries)
    if load.state.ready is None:
        raise RolloutError(f"{path}: rollout {archive.rollout_id} was archived before it was ready")
    return trainer_samples(load.rollout())


def archive_files(directory: str | os.PathLike[str]) -> list[Path]:
    """The archive files (``*.rollout``, or any file) of ``directory``, sorted by name: the
    order a directory of per-iteration archives is replayed in."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError(f"stored rollouts: {root} is not a directory")
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ConfigError(f"stored rollouts: {root} holds no archive file")
    return files


def reuse_source(sources: Sequence[str], iteration: int, *, repeat_first: bool = False) -> str:
    """The stored rollout iteration ``iteration`` (from 0) reuses: ``sources[iteration]``, or
    ``sources[0]`` for every iteration with ``repeat_first``. Past the end of ``sources``
    raises ``ConfigError`` naming how many there are."""
    if not sources:
        raise ConfigError("stored rollouts: no source given")
    if iteration < 0:
        raise ConfigError(f"stored rollouts: iteration must be >= 0, got {iteration}")
    if repeat_first:
        return sources[0]
    if iteration >= len(sources):
        raise ConfigError(
            f"stored rollouts: iteration {iteration} has no stored rollout (there are "
            f"{len(sources)}; reuse the first for every iteration with repeat_first)"
        )
    return sources[iteration]


async def _source_entries(log: EventLog, source: str) -> tuple[str, str, list[RawEntry]]:
    """``(kind, source rollout id, raw entries)`` of a source: an archive file when one exists
    at that path, else a rollout id on ``log``."""
    if os.path.isfile(source):
        archive = read_archive(source)
        return "archive", archive.rollout_id, archive.entries
    try:
        stream = log.names.rollout(source)
    except ConfigError as exc:
        raise ConfigError(f"reuse: {source!r} is neither an archive file nor a rollout id") from exc
    entries = await log.read_raw(stream)
    if not entries:
        raise RolloutError(
            f"reuse: {source!r} is neither an archive file nor a rollout on this log "
            f"(stream {stream} is empty or missing)"
        )
    return "rollout", source, entries


def _events(source: str, entries: Sequence[RawEntry]) -> tuple[list[Event], RolloutReady]:
    events: list[Event] = []
    ready: RolloutReady | None = None
    for _entry_id, raw in entries:
        try:
            ev = decode(raw)
        except DecodeError:
            continue  # the source's owner dead-lettered it; replay skips it too
        events.append(ev)
        if ready is None and isinstance(ev, RolloutReady):
            ready = ev
    if ready is None:
        raise RolloutError(f"reuse: {source} is not ready (its stream has no RolloutReady)")
    return events, ready


def _digest(entries: Sequence[RawEntry]) -> str:
    h = hashlib.sha256()
    for _entry_id, raw in entries:
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


async def reuse_rollout(
    log: EventLog, source: str, *, rollout_id: str, iteration: int
) -> RolloutReady:
    """Make rollout ``rollout_id`` (iteration ``iteration``) out of the stored rollout
    ``source`` (see the module docstring); returns its ``RolloutReady``."""
    kind, source_id, entries = await _source_entries(log, source)
    events, ready = _events(source, entries)
    digest = _digest(entries)
    stream = log.names.rollout(rollout_id)
    head = RolloutReused(
        rollout_id=rollout_id, iteration=iteration, source=str(source), source_kind=kind,
        source_rollout_id=source_id, source_sha256=digest, n_events=len(events),
        n_skipped=len(entries) - len(events),
    )
    try:
        await log.append_if_last(stream, [head, *events], EMPTY_ID)
    except AppendConflict:
        first = await log.read(stream, "-", "+", count=1)
        found = first[0].event if first else None
        if not (isinstance(found, RolloutReused) and found.source_sha256 == digest):
            raise ConfigError(
                f"reuse: rollout {rollout_id} exists already and is not a reuse of {source}"
            ) from None
        iteration = found.iteration  # a retry finishes the first call's rollout
    copy = ready.model_copy(update={"rollout_id": rollout_id, "iteration": iteration})
    await log.append_once(log.names.control, copy, log.names.once(f"reused-{rollout_id}"))
    return copy
