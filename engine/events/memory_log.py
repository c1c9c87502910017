"""The event log in memory: plain Python on one event loop, for tests and embedding.

:class:`MemoryStore` holds what one Redis server would; each :class:`MemoryEventLog` on it
is one process's view. The semantics are Redis's (ids from the wall clock, encoded entries,
deliveries and idle times counted as XREADGROUP, XAUTOCLAIM and XCLAIM do), held equal by
``tests/events/test_log_contract.py``. A step is atomic because nothing awaits inside it;
a step over keys of several cluster slots is refused, as on a cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, TypeVar

from engine.errors import AppendConflict, LogError
from engine.events.base import Envelope, Event
from engine.events.ids import EMPTY_ID, MAX_SEQ, format_id, id_after, parse_id
from engine.events.log import ClaimResult, EventLog, RawEntry, RawStreamEntry
from engine.events.log_base import FIELD, HAND_BACK_IDLE_MS, LogBase, Row
from engine.events.names import StreamNames, check_one_slot

__all__ = ["MemoryEventLog", "MemoryStore"]

Id = tuple[int, int]
T = TypeVar("T")


def _now_ms() -> float:
    return time.monotonic() * 1000.0


@dataclass(slots=True)
class _Pending:
    consumer: str
    delivered_ms: float
    times: int = 1


@dataclass(slots=True)
class _Group:
    last_delivered: Id
    pending: dict[str, _Pending] = field(default_factory=dict)
    seen_ms: dict[str, float] = field(default_factory=dict)  # consumer -> last active

    def own(self, consumer: str) -> list[str]:
        return sorted((i for i, p in self.pending.items() if p.consumer == consumer),
                      key=parse_id)


@dataclass(slots=True)
class _Stream:
    ids: list[Id] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)  # (id, fields), parallel to ids
    last: Id = (0, 0)  # the last id handed out, kept when entries are trimmed
    groups: dict[str, _Group] = field(default_factory=dict)

    def add(self, fields: Mapping[bytes, bytes], entry_id: str | None = None) -> str:
        if entry_id is None:
            ms = int(time.time() * 1000)
            new = (ms, 0) if ms > self.last[0] else (self.last[0], self.last[1] + 1)
        elif (new := parse_id(entry_id)) <= self.last:
            raise LogError(
                f"append of {entry_id}: the id must be above the stream's last, "
                f"{format_id(*self.last)}"
            )
        self.last = new
        entry_id = format_id(*new)
        self.ids.append(new)
        self.rows.append((entry_id, fields))
        return entry_id

    def after(self, position: Id, count: int | None = None) -> list[Row]:
        lo = bisect_right(self.ids, position)
        return self.rows[lo : None if count is None else lo + count]

    def span(self, start: str, end: str, count: int | None) -> list[Row]:
        lo = _bound(self.ids, start, low=True)
        hi = _bound(self.ids, end, low=False)
        rows = self.rows[lo:hi] if lo < hi else []
        return rows if count is None else rows[:count]

    def get(self, entry_id: str) -> Row | None:
        key = parse_id(entry_id)
        i = bisect_left(self.ids, key)
        return self.rows[i] if i < len(self.ids) and self.ids[i] == key else None

    def drop_below(self, floor: Id) -> int:
        n = bisect_left(self.ids, floor)
        del self.ids[:n], self.rows[:n]
        return n


def _bound(ids: list[Id], bound: str, *, low: bool) -> int:
    """The index a range bound cuts ``ids`` at: ``-``, ``+``, ``(id`` (exclusive), an id, or
    a bare ``<ms>`` (its first id as a start, its last as an end), as XRANGE reads them."""
    if bound == "-":
        return 0
    if bound == "+":
        return len(ids)
    exclusive = bound.startswith("(")
    text = bound[1:] if exclusive else bound
    key = parse_id(text) if "-" in text or low else (int(text), MAX_SEQ)
    return bisect_right(ids, key) if exclusive == low else bisect_left(ids, key)


class MemoryStore:
    """What one Redis holds, shared by the :class:`MemoryEventLog` views on it."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.markers: dict[str, float] = {}  # marker -> expiry (time.monotonic())
        self.sets: dict[str, set[str]] = {}
        self.values: dict[str, bytes] = {}
        self._appended: asyncio.Event | None = None

    def add(self, stream: str, fields: Mapping[bytes, bytes], entry_id: str | None = None) -> str:
        entry_id = self.streams.setdefault(stream, _Stream()).add(fields, entry_id)
        if self._appended is not None:
            self._appended.set()
            self._appended = None
        return entry_id

    async def wait(self, read: Callable[[], T], block_ms: int) -> T:
        """``read()`` until it finds something or ``block_ms`` have passed (0: once). It
        yields to the loop first, as a round trip to Redis would, so a stop or a writer
        can run in between."""
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + block_ms / 1000.0
        while True:
            found = read()
            remaining = deadline - loop.time()
            if found or remaining <= 0:
                return found
            if self._appended is None:
                self._appended = asyncio.Event()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that lands as the event fires, and the reader would wait on forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._appended.wait()


class MemoryEventLog(LogBase):
    """The :class:`~engine.events.log.EventLog` port on ``store`` (None: a new one)."""

    def __init__(
        self,
        store: MemoryStore | None = None,
        *,
        names: StreamNames | None = None,
        producer: str = "",
        max_deliveries: int = 5,
        block_ms: int = 2000,
    ) -> None:
        super().__init__(
            names=names, producer=producer, max_deliveries=max_deliveries, block_ms=block_ms
        )
        self.store = store if store is not None else MemoryStore()
        self._streams = self.store.streams

    # ------------------------------------------------------------------ writing

    def append_fields(
        self, stream: str, fields: Mapping[bytes, bytes], entry_id: str | None = None
    ) -> str:
        """Store ``fields`` undecoded at ``entry_id`` (above the stream's last id): for
        tests, a broken writer's entry or an archive's at its recorded id."""
        return self.store.add(stream, dict(fields), entry_id)

    async def append(
        self, stream: str, event: Event, *, causation: Envelope | str | None = None
    ) -> str:
        return self.store.add(stream, {FIELD: self._encode(event, causation)})

    async def append_many(
        self, items: Sequence[tuple[str, Event]], *, causation: Envelope | str | None = None
    ) -> list[str]:
        encoded = [(stream, self._encode(ev, causation)) for stream, ev in items]
        return [self.store.add(stream, {FIELD: data}) for stream, data in encoded]

    async def append_if_last(
        self,
        stream: str,
        events: Event | Sequence[Event],
        expected_last: str,
        *,
        also: Sequence[tuple[str, Event]] = (),
        causation: Envelope | str | None = None,
    ) -> list[str]:
        batch = [events] if isinstance(events, Event) else list(events)
        if not batch:
            raise ValueError("append_if_last needs at least one event")
        check_one_slot(f"compare-and-append on {stream}", [stream, *(s for s, _ in also)])
        items = [(stream, ev) for ev in batch] + list(also)
        encoded = [(s, self._encode(ev, causation)) for s, ev in items]
        current = await self.last_id(stream)
        if current != expected_last:
            raise AppendConflict(stream, expected_last, current)
        return [self.store.add(s, {FIELD: data}) for s, data in encoded]

    async def append_once(
        self,
        stream: str,
        event: Event,
        marker: str,
        *,
        ttl_s: int = 86_400,
        causation: Envelope | str | None = None,
    ) -> str | None:
        check_one_slot(f"append-once on {stream}", [stream, marker])
        data = self._encode(event, causation)
        now = time.monotonic()
        if self.store.markers.get(marker, 0.0) > now:
            return None
        self.store.markers[marker] = now + ttl_s
        return self.store.add(stream, {FIELD: data})

    async def _write_letters(self, letters: Sequence[tuple[str, bytes]]) -> int:
        seen = self.store.sets.setdefault(self.names.dead_seen, set())
        written = 0
        for key, data in letters:
            if key not in seen:
                seen.add(key)
                self.store.add(self.names.dead, {FIELD: data})
                written += 1
        return written

    async def last_id(self, stream: str) -> str:
        st = self._streams.get(stream)
        return st.rows[-1][0] if st and st.rows else EMPTY_ID

    async def first_id(self, stream: str) -> str:
        st = self._streams.get(stream)
        return st.rows[0][0] if st and st.rows else EMPTY_ID

    # ------------------------------------------------------------------ reading

    def _after(self, stream: str, position: str, count: int | None = None) -> list[Row]:
        st = self._streams.get(stream)
        return [] if st is None else st.after(parse_id(position), count)

    async def read(
        self,
        stream: str,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        st = self._streams.get(stream)
        rows = [] if st is None else st.span(start, end, count)
        return await self._decode_rows(stream, rows, dead_letter=dead_letter)

    async def read_all(
        self,
        stream: str,
        *,
        after: str | None = None,
        page: int = 2000,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        rows = self._after(stream, after or EMPTY_ID)
        return await self._decode_rows(stream, rows, dead_letter=dead_letter)

    async def _tail_rows(
        self, positions: Mapping[str, str], block_ms: int | None, count: int
    ) -> list[tuple[str, list[Row]]]:
        """XREAD: at most ``count`` entries of each stream past its position (``$``: its
        last entry now), waiting up to ``block_ms``."""
        fixed = {
            s: (format_id(*self._streams[s].last) if s in self._streams else EMPTY_ID)
            if p == "$" else p
            for s, p in positions.items()
        }

        def read() -> list[tuple[str, list[Row]]]:
            found = [(s, self._after(s, p, count)) for s, p in fixed.items()]
            return [(s, rows) for s, rows in found if rows]

        return await self.store.wait(read, self.block_ms if block_ms is None else block_ms)

    async def tail(
        self,
        positions: Mapping[str, str],
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        for stream, rows in await self._tail_rows(positions, block_ms, count):
            out.extend(await self._decode_rows(stream, rows, dead_letter=dead_letter))
        return out

    async def read_after(
        self,
        stream: str,
        after: str,
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> tuple[list[Envelope], str]:
        found = await self._tail_rows({stream: after}, block_ms, count)
        if not found:
            return [], after
        rows = found[0][1]
        return await self._decode_rows(stream, rows, dead_letter=dead_letter), rows[-1][0]

    async def read_raw(
        self, stream: str, *, after: str | None = None, page: int = 2000, limit: int | None = None
    ) -> list[RawEntry]:
        if limit is not None and limit < 1:
            raise ValueError(f"read_raw: limit must be at least 1, got {limit}")
        rows = self._after(stream, after or EMPTY_ID, limit)
        return [(i, bytes(fields.get(FIELD, b""))) for i, fields in rows]

    async def tail_raw(
        self, positions: Mapping[str, str], *, block_ms: int | None = None, count: int = 500
    ) -> list[RawStreamEntry]:
        return [
            (stream, i, bytes(fields.get(FIELD, b"")))
            for stream, rows in await self._tail_rows(positions, block_ms, count)
            for i, fields in rows
        ]

    async def read_raw_ranges(
        self, stream: str, ranges: Sequence[tuple[str, str, int | None]]
    ) -> list[list[RawEntry]]:
        st = self._streams.get(stream)
        return [
            [] if st is None
            else [(i, bytes(fields.get(FIELD, b""))) for i, fields in st.span(lo, hi, n)]
            for lo, hi, n in ranges
        ]

    async def list_streams(self, pattern: str) -> list[str]:
        return sorted(name for name in self._streams if fnmatchcase(name, pattern))

    async def stream_length(self, stream: str) -> int:
        st = self._streams.get(stream)
        return 0 if st is None else len(st.ids)

    # ------------------------------------------------------------------ groups

    def _group(self, stream: str, group: str) -> tuple[_Stream, _Group]:
        st = self._streams.get(stream)
        g = None if st is None else st.groups.get(group)
        if st is None or g is None:
            raise LogError(f"NOGROUP no such stream {stream!r} or consumer group {group!r}")
        return st, g

    async def ensure_group(self, stream: str, group: str, *, start: str = "0") -> None:
        st = self._streams.setdefault(stream, _Stream())
        if group not in st.groups:
            st.groups[group] = _Group(st.last if start == "$" else parse_id(start))

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Envelope]:
        targets = [(s, *self._group(s, group)) for s in streams]

        def deliver() -> list[tuple[str, list[Row]]]:
            now = _now_ms()
            out = []
            for stream, st, g in targets:
                g.seen_ms[consumer] = now
                rows = st.after(g.last_delivered, count)
                if rows:
                    g.last_delivered = parse_id(rows[-1][0])
                    for entry_id, _fields in rows:
                        g.pending[entry_id] = _Pending(consumer, now)
                    out.append((stream, rows))
            return out

        block = self.block_ms if block_ms is None else block_ms
        envs: list[Envelope] = []
        for stream, rows in await self.store.wait(deliver, block):
            envs.extend(await self._decode_rows(stream, rows, group=group))
        return envs

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        st = self._streams.get(stream)
        g = None if st is None else st.groups.get(group)
        if g is None:
            return 0
        return sum(g.pending.pop(i, None) is not None for i in ids)

    def _owned(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> tuple[list[_Pending], list[str]]:
        """The pending records of ``ids`` this consumer owns, and the ids it does not;
        an entry gone from the stream leaves the pending list (as XCLAIM does)."""
        st, g = self._group(stream, group)
        g.seen_ms[consumer] = _now_ms()
        owned: list[_Pending] = []
        lost: list[str] = []
        for entry_id in ids:
            p = g.pending.get(entry_id)
            if p is None or p.consumer != consumer:
                lost.append(entry_id)
            elif st.get(entry_id) is None:
                del g.pending[entry_id]
            else:
                owned.append(p)
        return owned, lost

    async def keep_alive(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        owned, lost = self._owned(stream, group, consumer, ids)
        for p in owned:
            p.delivered_ms = _now_ms()
        return lost

    async def hand_back(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        owned, lost = self._owned(stream, group, consumer, ids)
        for p in owned:
            p.delivered_ms = _now_ms() - HAND_BACK_IDLE_MS
            p.times = max(p.times - 1, 0)
        return lost

    async def claim_idle(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = 100,
        ack_dead: bool = True,
    ) -> ClaimResult:
        st, g = self._group(stream, group)
        now = _now_ms()
        g.seen_ms[consumer] = now
        rows: list[Row] = []
        for entry_id in sorted(g.pending, key=parse_id):
            p = g.pending[entry_id]
            if len(rows) >= count or now - p.delivered_ms < min_idle_ms:
                continue
            row = st.get(entry_id)
            if row is None:  # deleted from the stream while pending: nothing to run
                del g.pending[entry_id]
                continue
            g.pending[entry_id] = _Pending(consumer, now, p.times + 1)
            rows.append(row)
        times = {i: g.pending[i].times for i, _ in rows}
        return await self._split_deliveries(stream, group, rows, times, ack_dead=ack_dead)

    def _pending_rows(self, st: _Stream, ids: Sequence[str]) -> list[Row]:
        return [st.get(i) or (i, None) for i in ids]

    async def read_own_pending(
        self,
        group: str,
        consumer: str,
        stream: str,
        *,
        count: int = 10_000,
        limit: bool = True,
        ack_dead: bool = True,
    ) -> ClaimResult:
        st, g = self._group(stream, group)
        now = _now_ms()
        g.seen_ms[consumer] = now
        ids = g.own(consumer)[:count]
        for entry_id in ids:  # a re-read is a delivery, as XREADGROUP from 0 counts it
            g.pending[entry_id].delivered_ms = now
            g.pending[entry_id].times += 1
        rows = self._pending_rows(st, ids)
        if not limit:
            return ClaimResult(entries=await self._decode_rows(stream, rows, group=group))
        times = {i: g.pending[i].times for i in ids}
        return await self._split_deliveries(stream, group, rows, times, ack_dead=ack_dead)

    async def unread_own_pending(
        self, group: str, consumer: str, stream: str, *, skip: Collection[str] = ()
    ) -> ClaimResult:
        st, g = self._group(stream, group)
        ids = [i for i in g.own(consumer) if i not in set(skip)]
        result = ClaimResult(deliveries={i: g.pending[i].times for i in ids})
        result.entries = await self._decode_rows(stream, self._pending_rows(st, ids), group=group)
        return result

    async def pending_count(self, stream: str, group: str) -> int:
        return len(self._group(stream, group)[1].pending)

    async def group_consumers(self, stream: str, group: str) -> dict[str, int]:
        st = self._streams.get(stream)
        g = None if st is None else st.groups.get(group)
        now = _now_ms()
        return {} if g is None else {c: int(now - t) for c, t in g.seen_ms.items()}

    # ------------------------------------------------------------------ maintenance

    async def trim_acked(
        self, stream: str, *, before: str | None = None, require: Collection[str] = ()
    ) -> int:
        st = self._streams.get(stream)
        if st is None:
            raise LogError(f"trim of {stream}: no such key")
        if not st.groups or set(require) - set(st.groups):
            return 0
        floor = min(
            min([parse_id(id_after(format_id(*g.last_delivered))),
                 *(parse_id(i) for i in g.pending)])
            for g in st.groups.values()
        )
        if before is not None:
            floor = min(floor, parse_id(before))
        return st.drop_below(floor)

    async def trim_before(self, stream: str, keep_from: str) -> int:
        st = self._streams.get(stream)
        return 0 if st is None else st.drop_below(parse_id(keep_from))

    async def delete_stream(self, stream: str) -> bool:
        return self._streams.pop(stream, None) is not None

    async def dead_marks(self) -> set[str]:
        return set(self.store.sets.get(self.names.dead_seen, ()))

    async def forget_dead_marks(self, marks: Collection[str]) -> int:
        seen = self.store.sets.get(self.names.dead_seen, set())
        gone = seen & set(marks)
        seen -= gone
        return len(gone)

    async def write_snapshot(self, name: str, data: bytes) -> None:
        self.store.values[self.names.snapshot(name)] = bytes(data)

    async def read_snapshot(self, name: str) -> bytes | None:
        return self.store.values.get(self.names.snapshot(name))

    async def aclose(self) -> None:
        """Nothing to release: the store lives on for the other logs on it."""


if TYPE_CHECKING:  # mypy holds the class to the port
    _PORT: EventLog = MemoryEventLog()
