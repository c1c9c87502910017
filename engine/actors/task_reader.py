"""``TaskReader``: the tasks of a worker's batches, read from their rollout streams.

Tasks come from the rollout stream, read undecoded (only their type and sample id are looked
at, ``codec.peek``): the worker keeps, per rollout (an LRU of ``rollouts``), the request copy,
an index of where each task entry is (about two bytes a task) and the last ``window`` entries
as read. A batch's tasks are taken from the window, re-read where the index places them, or
read on in stream order when the batch names a sample not read yet; they are decoded then and
held by the batch's plan only, so a worker's memory follows its batches in flight, not the
rollout's size.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.errors import DecodeError
from engine.events.base import Event
from engine.events.catalog import RolloutRequested, TaskFetched, TaskJoined
from engine.events.codec import decode, peek
from engine.events.log import EventLog

__all__ = ["MARK_EVERY", "TaskReader"]

logger = logging.getLogger(__name__)

_TASK_TYPES = frozenset({"TaskFetched", "TaskJoined"})


@dataclass(slots=True)
class _RolloutTasks:
    """What the worker knows of one rollout's tasks, bounded by what its batches need.

    Entries are read in stream order, undecoded, and only peeked at (``codec.peek``: type
    and sample id). Of each task entry the worker keeps an *index*, not the entry: where it
    is among the rollout's task entries (its ordinal). A sample id the planner gave
    (``<rollout>:s<k>`` at ordinal ``k``) costs one byte; any other id (a carried sample, a
    hand-written stream) a dict entry. Every ``MARK_EVERY``-th ordinal records the id of the
    stream entry before it, so a batch's entries are re-read with one ranged read per run of
    nearby ordinals. The entries read last (``window`` of them) are kept as read, so a batch
    admitted soon after its tasks were read takes them without a second read; a task is
    decoded when a batch needs it and kept only by that batch's plan. Memory per rollout is
    the window plus about two bytes per task, whatever the rollout's size."""

    rollout_id: str
    window: int
    request: RolloutRequested | None = None
    position: str = "0-0"  # the last entry read in order
    count: int = 0  # task entries read in order (the next one's ordinal)
    planned: bytearray = field(default_factory=bytearray)  # 1: ordinal k holds <prefix>k
    others: dict[str, int] = field(default_factory=dict)  # sample id -> ordinal, the rest
    marks: list[str] = field(default_factory=list)  # id before ordinal c * MARK_EVERY
    recent: OrderedDict[str, bytes] = field(default_factory=OrderedDict)  # read, not taken
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    prefix: str = ""

    def __post_init__(self) -> None:
        self.prefix = f"{self.rollout_id}:s"

    def locate(self, sample_id: str) -> int | None:
        """The ordinal of the sample's first task entry, if it was read (None: not yet)."""
        k = self.others.get(sample_id)
        if k is not None:
            return k
        if not sample_id.startswith(self.prefix):
            return None
        tail = sample_id[len(self.prefix) :]
        if not (tail.isascii() and tail.isdigit()):
            return None
        k = int(tail)
        if k < self.count and self.planned[k] and str(k) == tail:
            return k
        return None

    def add(self, before: str, sample_id: str, raw: bytes) -> bool:
        """Index the next task entry in stream order (``before``: the id of the stream
        entry before it); True when it is its sample's first (a repeat is ignored, as the
        rollout fold ignores it), which is then kept in the window."""
        k = self.count
        if k % MARK_EVERY == 0:
            self.marks.append(before)
        if sample_id == f"{self.prefix}{k}":
            first = sample_id not in self.others
            self.planned.append(first)
        else:
            first = self.locate(sample_id) is None
            self.planned.append(0)
            if first:
                self.others[sample_id] = k
        self.count = k + 1
        if first:
            self.recent[sample_id] = raw
            if len(self.recent) > self.window:
                self.recent.popitem(last=False)
        return first


MARK_EVERY = 64
"""Task entries between two marks of a rollout's task index (a mark: one entry id)."""


def _resolve(
    events: Mapping[str, Event | None], sample_id: str, seen: frozenset[str] = frozenset()
) -> TaskFetched | None:
    """The sample's task from the decoded entries; a ``TaskJoined`` is its group's first task
    (None: no entry, an entry that did not decode, or a group whose task is unknown)."""
    ev = events.get(sample_id)
    if isinstance(ev, TaskJoined):
        if sample_id in seen:
            return None  # joined in a cycle: no task
        first = _resolve(events, ev.same_as, seen | {sample_id})
        return None if first is None else ev.task(first)
    return ev if isinstance(ev, TaskFetched) else None


class TaskReader:
    """See the module docstring; one per worker, shared by its batches."""

    def __init__(self, log: EventLog, *, window: int, rollouts: int) -> None:
        self.log = log
        self.names = log.names
        self.window = window
        self.rollouts = rollouts
        self.cache: OrderedDict[str, _RolloutTasks] = OrderedDict()  # by rollout id, LRU

    def _rollout(self, rollout_id: str) -> _RolloutTasks:
        cached = self.cache.get(rollout_id)
        if cached is None:
            cached = self.cache[rollout_id] = _RolloutTasks(rollout_id, window=self.window)
            while len(self.cache) > self.rollouts:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(rollout_id)
        return cached

    async def batch_tasks(
        self, rollout_id: str, needed: Sequence[str]
    ) -> tuple[RolloutRequested | None, dict[str, TaskFetched]]:
        """The rollout's request copy and the tasks of ``needed`` (a sample without a task
        is left out: the batch aborts it), a ``TaskJoined`` resolved to its group's task."""
        cached = self._rollout(rollout_id)
        stream = self.names.rollout(rollout_id)
        events: dict[str, Event | None] = {}
        async with cached.lock:
            want = set(needed)
            while want:  # the batch's entries, then the group tasks they are joined on
                raws = await self._task_entries(cached, stream, want)
                for sid in want:
                    raw = raws.get(sid)
                    ev: Event | None = None
                    if raw is not None:
                        try:
                            ev = decode(raw)
                        except DecodeError as exc:  # its owner, the finalizer, dead-letters it
                            logger.warning("skipping the undecodable task of %s: %s", sid, exc)
                    events[sid] = ev
                want = {
                    ev.same_as
                    for ev in events.values()
                    if isinstance(ev, TaskJoined) and ev.same_as not in events
                }
        out: dict[str, TaskFetched] = {}
        for sid in needed:
            task = _resolve(events, sid)
            if task is not None:
                out[sid] = task
        return cached.request, out

    async def _task_entries(
        self, cached: _RolloutTasks, stream: str, want: set[str]
    ) -> dict[str, bytes]:
        """The first task entry of each sample of ``want`` that the stream has: taken from
        the window, re-read where the index places it, or read on in stream order (only
        until every sample is found: a batch can start while the rest of a large plan is
        still unread)."""
        got: dict[str, bytes] = {}
        located: dict[int, str] = {}
        unknown: set[str] = set()
        for sid in want:
            raw = cached.recent.pop(sid, None)
            if raw is not None:
                got[sid] = raw
                continue
            k = cached.locate(sid)
            if k is None:
                unknown.add(sid)
            else:
                located[k] = sid
        if located:
            for k, raw in (await self._reread(cached, stream, sorted(located))).items():
                head = peek(raw)
                if head is not None and head[1] == located[k]:
                    got[located[k]] = raw
        while unknown:
            entries = await self.log.read_raw(stream, after=cached.position, limit=1000)
            if not entries:
                break
            before = cached.position
            for entry_id, raw in entries:
                head = peek(raw)
                if head is not None:  # else not an event: its owner dead-letters it
                    kind, sample_id, _same_as = head
                    if kind in _TASK_TYPES:
                        if cached.add(before, sample_id, raw) and sample_id in unknown:
                            cached.recent.pop(sample_id, None)
                            got[sample_id] = raw
                            unknown.discard(sample_id)
                    elif kind == "RolloutRequested" and cached.request is None:
                        try:
                            request = decode(raw)
                        except DecodeError:
                            request = None
                        if isinstance(request, RolloutRequested):
                            cached.request = request
                before = entry_id
            cached.position = entries[-1][0]
        return got

    async def _reread(
        self, cached: _RolloutTasks, stream: str, ordinals: Sequence[int]
    ) -> dict[int, bytes]:
        """The task entries at ``ordinals`` (sorted, each already read once), re-read from
        the marks before them: one ranged read per run of ordinals less than
        ``MARK_EVERY`` apart, all in one round trip."""
        runs: list[list[int]] = []  # [first ordinal read, last ordinal wanted]
        for k in ordinals:
            if runs and k - runs[-1][1] <= MARK_EVERY:
                runs[-1][1] = k
            else:
                runs.append([k - k % MARK_EVERY, k])
        marks = [cached.marks[first // MARK_EVERY] for first, _last in runs]
        replies = await self.log.read_raw_ranges(
            stream,
            [
                ("-" if mark == "0-0" else f"({mark}", "+", last - first + 1)
                for mark, (first, last) in zip(marks, runs, strict=True)
            ],
        )
        wanted = set(ordinals)
        out: dict[int, bytes] = {}
        for (first, last), rows in zip(runs, replies, strict=True):
            k = first
            while rows:
                for _entry_id, raw in rows:
                    head = peek(raw)
                    if head is None or head[0] not in _TASK_TYPES:
                        continue
                    if k in wanted:
                        out[k] = raw
                    k += 1
                    if k > last:
                        break
                if k > last:
                    break
                # other entries among the run's tasks: read on past them
                rows = await self.log.read_raw(stream, after=rows[-1][0], limit=last - k + 1)
        return out
