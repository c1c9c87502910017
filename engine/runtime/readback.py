"""Reading a rollout stream for its samples: the fold from raw pages, then entries by id.

The one fold of a rollout stream (:class:`~engine.projections.rollout.RolloutProjection`)
records, per sample, the entry ids its whole sample is built from; this module is where
that meets the log:

* :class:`StreamLoad` folds raw entries as they are read (pages of ``read_raw_ranges``, or
  blocking ``tail_raw`` reads of a :class:`LoadFollower`), decoding each with
  ``codec.decode``; an entry that does not decode is skipped, as every reader but the
  stream's owner skips it. For the trainer's ``load`` it feeds the fold only the entries
  samples are built from (tasks, terminals, teacher scorings, stored prompts, the request
  and the ready event: the rest changes none of their positions, so it is not even
  decoded) and can keep them as read (``keep=True``), so the samples are built with no
  second read.
* :func:`read_entries` / :func:`read_back` read entries back by id: the ids are grouped
  into a few ranges (``projections.readback.ranges``) and read in one round trip per
  :data:`_READ_BATCH` ids.
* :func:`iter_samples` is ``iter_load``: a first pass keeps the records only, then each
  chunk of ``RolloutReady.sample_ids`` reads back its entries and builds its samples, so a
  trainer that consumes chunk by chunk holds the records, one page and one chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Iterable, Sequence

from engine.errors import DecodeError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    PromptStored,
    SampleAborted,
    SampleCompleted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
)
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID, exclusive
from engine.events.log import EventLog, RawEntry
from engine.projections.base import Folded
from engine.projections.lanes import CeChunk, Lane, ce_chunks, plan_ce, request_lane
from engine.projections.readback import Rollout, ranges, wanted
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.projections.samples import ce_samples, check_terminal, samples_named, trainer_samples
from engine.runtime.consumer import Backoff
from engine.runtime.follower import Follower
from engine.runtime.rebuild import gc_paused
from engine.sample import Sample

__all__ = [
    "LoadFollower",
    "StreamLoad",
    "iter_samples",
    "read_back",
    "read_entries",
    "read_tasks",
    "scan",
    "type_name",
]

LOAD_PAGE = 4096  # entries per page when a rollout is read for its samples
_CE_PLAN_PAGE = 1024  # trajectories read back at a time to plan the CE lane
_READ_BATCH = 4096  # entry ids read back per round trip

_SAMPLE_PARTS = frozenset(
    {
        b"TaskFetched",
        b"TaskJoined",
        b"SampleCompleted",
        b"SampleAborted",
        b"TeacherScored",
        b"PromptStored",
        b"RolloutRequested",
        b"RolloutReady",
    }
)
_KEPT = (TaskFetched, TaskJoined, SampleCompleted, SampleAborted, TeacherScored, PromptStored)
_TYPE_KEY = b"\xa4type"  # msgpack fixstr "type"


def type_name(raw: bytes) -> bytes | None:
    """The event type an entry names, when it is in the canonical form ``codec.encode``
    writes (a map whose first key is ``type``, a short string); None otherwise (the entry
    must then be decoded to tell)."""
    head = raw[0] if raw else 0
    if 0x80 <= head <= 0x8F:  # fixmap
        at = 1
    elif head == 0xDE:  # map 16
        at = 3
    else:
        return None
    if not raw.startswith(_TYPE_KEY, at):
        return None
    size = raw[at + 5] - 0xA0 if len(raw) > at + 5 else -1
    if not 0 <= size < 32:  # a fixstr
        return None
    return raw[at + 6 : at + 6 + size]


class StreamLoad:
    """A rollout stream folded for its samples from raw entries, as they are read (see the
    module docstring); ``keep``: the entries samples are built from are kept as read."""

    def __init__(self, stream: str, *, keep: bool) -> None:
        self.stream = stream
        self._projection = RolloutProjection()
        self.state = self._projection.initial()
        self.entries: dict[str, Event] = {}
        self._keep = keep

    def feed(self, rows: Iterable[RawEntry]) -> None:
        """Fold the next entries of the stream, in order."""
        evolve, state, stream = self._projection.evolve, self.state, self.stream
        entries = self.entries if self._keep else None
        for entry_id, raw in rows:
            name = type_name(raw)
            if name is not None and name not in _SAMPLE_PARTS:
                continue
            try:
                ev = decode(raw)
            except DecodeError:
                continue  # its stream's owner dead-letters it
            evolve(state, Envelope(stream, entry_id, ev))
            if entries is not None and isinstance(ev, _KEPT):
                entries[entry_id] = ev

    def rollout(self) -> Rollout:
        return Rollout(self.state, self.entries)


async def scan(
    log: EventLog, load: StreamLoad, *, page: int = LOAD_PAGE, start: str = "-"
) -> None:
    """Fold every entry of the stream from ``start`` on into ``load``, ``page`` raw entries
    at a time; the next page is asked for before this one is folded, so Redis serves it
    meanwhile."""
    stream = load.stream

    async def read(first: str) -> list[RawEntry]:
        (rows,) = await log.read_raw_ranges(stream, [(first, "+", page)])
        return rows

    pending: asyncio.Task[list[RawEntry]] | None = asyncio.create_task(read(start))
    try:
        while pending is not None:
            rows = await pending
            pending = None
            if len(rows) == page:
                pending = asyncio.create_task(read(exclusive(rows[-1][0])))
            load.feed(rows)
    finally:
        if pending is not None:
            pending.cancel()


class LoadFollower(Follower[RolloutState]):
    """``load`` kept live: the stream folded into it as it is written, with blocking reads
    of raw pages, until the fold holds the rollout's ``RolloutReady`` (``done``). What it
    had not read when it stops, a :func:`scan` from its position reads."""

    def __init__(self, log: EventLog, load: StreamLoad, *, backoff: Backoff) -> None:
        super().__init__(log, load.stream, RolloutProjection(), backoff=backoff)
        self.load = load
        self.folded = Folded(load.state, EMPTY_ID)

    async def _fetch(self, block_ms: int) -> list[Envelope]:
        rows = await self.log.tail_raw(
            {self.stream: self.position}, block_ms=block_ms, count=LOAD_PAGE
        )
        self.caught_up = len(rows) < LOAD_PAGE
        if rows:
            self.load.feed((entry_id, raw) for _stream, entry_id, raw in rows)
            self.done = self.load.state.ready is not None
            self._moved(Folded(self.load.state, rows[-1][1]))
        return []


async def read_entries(
    log: EventLog, stream: str, state: RolloutState, ids: Sequence[str]
) -> dict[str, Event]:
    """The entries ``ids`` (stream order) of ``stream``, decoded, by id; one that is gone or
    does not decode is left out (:class:`Rollout` names it when a sample needs it)."""
    out: dict[str, Event] = {}
    for at in range(0, len(ids), _READ_BATCH):
        part = ids[at : at + _READ_BATCH]
        keep = set(part)
        spans = ranges(state, part)
        replies = await log.read_raw_ranges(stream, [(a, b, None) for a, b in spans])
        for rows in replies:
            for entry_id, raw in rows:
                if entry_id in keep:
                    try:
                        out[entry_id] = decode(raw)
                    except DecodeError:
                        pass
    return out


async def read_back(
    log: EventLog,
    stream: str,
    state: RolloutState,
    sample_ids: Iterable[str],
    *,
    turns: bool = False,
) -> Rollout:
    """``state`` with the entries the samples of ``sample_ids`` are built from (and, with
    ``turns``, their turns), read back from ``stream``."""
    ids = wanted(state, sample_ids, turns=turns)
    return Rollout(state, await read_entries(log, stream, state, ids))


async def read_tasks(
    log: EventLog, stream: str, state: RolloutState, sample_ids: Iterable[str]
) -> dict[str, TaskFetched]:
    """The whole tasks of the samples of ``sample_ids`` the fold knows, read back."""
    known = [sid for sid in sample_ids if sid in state.samples]
    rollout = await read_back(log, stream, state, known)
    return {sid: rollout.task(state.samples[sid]) for sid in known}


async def load_samples(log: EventLog, stream: str) -> list[Sample]:
    """The trainer's samples of a ready rollout, from one pass over its stream."""
    load = StreamLoad(stream, keep=True)
    await scan(log, load)
    return trainer_samples(load.rollout())


async def iter_samples(
    log: EventLog, stream: str, chunk_size: int
) -> AsyncGenerator[list[Sample], None]:
    """The samples of :func:`load_samples`, ``chunk_size`` at a time (module docstring)."""
    load = StreamLoad(stream, keep=False)
    with gc_paused():
        # Pages of about a chunk's entries (a sample has a few): memory follows the caller's
        # chunk size, not the rollout's.
        await scan(log, load, page=min(LOAD_PAGE, max(256, 4 * chunk_size)))
    state = load.state
    ready = state.ready
    if ready is None or ready.dummy:
        # Nothing to stream (no ready event: the error; a dummy: one sample).
        with gc_paused():
            whole = trainer_samples(Rollout(state, {}))
        for at in range(0, len(whole), chunk_size):
            yield whole[at : at + chunk_size]
        return
    lane = request_lane(state.request)
    if lane is Lane.CE:
        async for sub_samples in _iter_ce(log, stream, state, chunk_size):
            yield sub_samples
        return
    ids = ready.sample_ids
    for at in range(0, len(ids), chunk_size):
        part = ids[at : at + chunk_size]
        with gc_paused():
            samples = samples_named(await read_back(log, stream, state, part), part, lane)
        yield samples
        del samples


async def _iter_ce(
    log: EventLog, stream: str, state: RolloutState, chunk_size: int
) -> AsyncGenerator[list[Sample], None]:
    """The CE lane's sub-samples, ``chunk_size`` at a time, in ``load``'s order: the plan
    (which trajectory gives which chunks, shuffled across the whole rollout) is made from
    the completed trajectories read back a page at a time, each kept as its chunks' bounds
    only; then each chunk of the plan reads back and builds its parents (a trajectory whose
    sub-samples fall in several chunks is read once per chunk)."""
    ready = state.ready
    assert ready is not None
    check_terminal(state.samples, state.rollout_id, ready.sample_ids)
    completed = [sid for sid in ready.sample_ids if state.samples[sid].completed]
    trajectories: list[tuple[str, list[CeChunk]]] = []
    page = min(_CE_PLAN_PAGE, max(256, chunk_size))  # memory follows the chunk size
    for at in range(0, len(completed), page):
        part = completed[at : at + page]
        with gc_paused():
            rollout = await read_back(log, stream, state, part)
            for sid in part:
                trajectories.append((sid, ce_chunks(rollout.completed(state.samples[sid]))))
            del rollout
    plan = plan_ce(state.request, trajectories).chunks
    del trajectories
    if not plan:
        yield [Sample.masked_dummy(policy_version=ready.policy_version)]
        return
    for at in range(0, len(plan), chunk_size):
        part_plan = plan[at : at + chunk_size]
        parents = list(dict.fromkeys(c.sample_id for c in part_plan))
        with gc_paused():
            samples = ce_samples(await read_back(log, stream, state, parents), part_plan)
        yield samples
        del samples
