"""The event log on Redis Streams (redis-py asyncio): the
:class:`engine.events.log.EventLog` the engine's processes run on.

Each entry has one field ``e``, the encoded event; every atomic step is one Lua script on
one cluster slot (``redis_scripts.py``); snapshots are plain keys. The consumer-group
methods are in ``redis_groups.py``, the client and error translation in
``redis_connect.py``. On a Redis Cluster a blocking read of streams on several slots reads
each slot concurrently and merges the replies.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from typing import Any

from engine.errors import AppendConflict
from engine.events import redis_scripts as lua
from engine.events.base import Envelope, Event
from engine.events.codec import encode
from engine.events.ids import EMPTY_ID, exclusive, format_id, id_after, parse_id
from engine.events.log import RawEntry, RawStreamEntry
from engine.events.log_base import FIELD, Row, _s, gc_paused
from engine.events.names import StreamNames, check_one_slot, key_slot
from engine.events.redis_connect import RedisClient, connect
from engine.events.redis_groups import RedisGroups, _rows_of
from engine.events.redis_settings import RedisSettings

__all__ = ["FIELD", "RedisClient", "RedisEventLog", "RedisSettings", "connect", "open_log"]


class RedisEventLog(RedisGroups):
    """The :class:`~engine.events.log.EventLog` port on Redis Streams. ``redis``, the
    client it closes in :meth:`aclose`, is public for this adapter's tests only."""

    # ------------------------------------------------------------------ writing

    async def append(
        self, stream: str, event: Event, *, causation: Envelope | str | None = None
    ) -> str:
        data = self._encode(event, causation)
        with self._io(f"XADD {stream}"):
            entry_id = await self._r.xadd(stream, {FIELD: data})
        return _s(entry_id)

    async def append_many(
        self,
        items: Sequence[tuple[str, Event]],
        *,
        causation: Envelope | str | None = None,
    ) -> list[str]:
        if not items:
            return []
        ref = causation.ref if isinstance(causation, Envelope) else causation
        producer = self.producer or None
        # A run of events to one stream is one script call (one key: cluster-safe), a
        # single event a plain XADD; all in one pipeline, encoded before anything is sent.
        runs: list[tuple[str, list[bytes]]] = []
        for stream, ev in items:
            data = encode(ev, producer=None if ev.producer else producer, causation=ref)
            if runs and runs[-1][0] == stream:
                runs[-1][1].append(data)
            else:
                runs.append((stream, [data]))
        with self._io(f"pipelined XADD of {len(items)} events"):
            async with self._r.pipeline(transaction=False) as pipe:
                for stream, datas in runs:
                    if len(datas) == 1:  # xadd() would rebuild its argument list per call
                        pipe.execute_command("XADD", stream, "*", FIELD, datas[0])
                    else:  # EVAL, not EVALSHA: nothing to load first or after a restart
                        pipe.execute_command("EVAL", lua.APPEND, 1, stream, *datas)
                replies = await pipe.execute()
        out: list[str] = []
        for (_stream, datas), reply in zip(runs, replies, strict=True):
            if len(datas) == 1:
                out.append(_s(reply))
            else:
                out.extend(_s(i) for i in reply)
        return out

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
        args: list[bytes | str | int] = [expected_last, len(batch)]
        args.extend(self._encode(ev, causation) for ev in batch)
        args.extend(self._encode(ev, causation) for _, ev in also)
        keys = [stream, *(s for s, _ in also)]
        check_one_slot(f"compare-and-append on {stream}", keys)
        with self._io(f"compare-and-append on {stream}"):
            result = await self._cas(keys=keys, args=args)
        if int(result[0]) != 1:
            raise AppendConflict(stream, expected_last, _s(result[1]))
        return [_s(i) for i in result[1:]]

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
        with self._io(f"append-once on {stream}"):
            entry_id = await self._once(keys=[stream, marker], args=[ttl_s, data])
        return None if entry_id is None else _s(entry_id)

    async def _write_letters(self, letters: Sequence[tuple[str, bytes]]) -> int:
        args = [part for letter in letters for part in letter]
        with self._io(f"dead-letter of {len(letters)} entries"):
            written = await self._dead_script(
                keys=[self.names.dead, self.names.dead_seen], args=args
            )
        return int(written)

    async def last_id(self, stream: str) -> str:
        with self._io(f"XREVRANGE {stream}"):
            rows = await self._r.xrevrange(stream, "+", "-", count=1)
        return _s(rows[0][0]) if rows else EMPTY_ID

    async def first_id(self, stream: str) -> str:
        with self._io(f"XRANGE {stream}"):
            rows = await self._r.xrange(stream, "-", "+", count=1)
        return _s(rows[0][0]) if rows else EMPTY_ID

    # ------------------------------------------------------------------ reading

    async def read(
        self,
        stream: str,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        with self._io(f"XRANGE {stream}"):
            rows = await self._r.xrange(stream, start, end, count=count)
        return await self._decode_rows(stream, rows, dead_letter=dead_letter)

    async def read_all(
        self,
        stream: str,
        *,
        after: str | None = None,
        page: int = 2000,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        with gc_paused():
            async for rows in self._pages(stream, after, page):
                out.extend(await self._decode_rows(stream, rows, dead_letter=dead_letter))
        return out

    async def _pages(
        self, stream: str, after: str | None, page: int, limit: int | None = None
    ) -> AsyncIterator[list[Row]]:
        """XRANGE past ``after`` a page at a time, at most ``limit`` rows in all."""
        cursor, n = after, 0
        while True:
            start = "-" if cursor is None else exclusive(cursor)
            count = page if limit is None else min(page, limit - n)
            with self._io(f"XRANGE {stream}"):
                rows = await self._r.xrange(stream, start, "+", count=count)
            if rows:
                yield rows
            n += len(rows)
            if len(rows) < count or (limit is not None and n >= limit):
                return
            cursor = _s(rows[-1][0])

    async def tail(
        self,
        positions: Mapping[str, str],
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        for raw_stream, rows in await self._xread(positions, count=count, block_ms=block_ms):
            out.extend(await self._decode_rows(_s(raw_stream), rows, dead_letter=dead_letter))
        return out

    async def _xread(
        self, positions: Mapping[str, str], *, count: int, block_ms: int | None
    ) -> list[tuple[Any, Any]]:
        """One XREAD, or on a cluster one per slot, concurrently, the replies merged."""
        block = self.block_ms if block_ms is None else block_ms
        groups: dict[int, dict[str, str]] = {}
        if self.cluster:
            for stream, position in positions.items():
                groups.setdefault(key_slot(stream), {})[stream] = position
        else:
            groups[0] = dict(positions)

        async def one(part: dict[str, str]) -> list[tuple[Any, Any]]:
            with self._io("XREAD"):
                return _rows_of(await self._r.xread(part, count=count, block=block or None))

        if len(groups) == 1:
            return await one(next(iter(groups.values())))
        replies = await asyncio.gather(*(one(part) for part in groups.values()))
        return [item for reply in replies for item in reply]

    async def read_after(
        self,
        stream: str,
        after: str,
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> tuple[list[Envelope], str]:
        block = self.block_ms if block_ms is None else block_ms
        with self._io(f"XREAD {stream}"):
            result = await self._r.xread({stream: after}, count=count, block=block or None)
        position = after
        out: list[Envelope] = []
        for _raw_stream, rows in _rows_of(result):
            if rows:
                position = _s(rows[-1][0])
                out.extend(await self._decode_rows(stream, rows, dead_letter=dead_letter))
        return out, position

    # ------------------------------------------------------------------ raw access

    async def read_raw(
        self, stream: str, *, after: str | None = None, page: int = 2000, limit: int | None = None
    ) -> list[RawEntry]:
        if limit is not None and limit < 1:
            raise ValueError(f"read_raw: limit must be at least 1, got {limit}")
        return [
            (_s(raw_id), bytes(fields.get(FIELD, b"")))
            async for rows in self._pages(stream, after, page, limit)
            for raw_id, fields in rows
        ]

    async def read_raw_ranges(
        self, stream: str, ranges: Sequence[tuple[str, str, int | None]]
    ) -> list[list[RawEntry]]:
        if not ranges:
            return []
        with self._io(f"XRANGE {stream} ({len(ranges)} ranges)"):
            async with self._r.pipeline(transaction=False) as pipe:
                for start, end, count in ranges:
                    pipe.xrange(stream, start, end, count=count)
                replies = await pipe.execute()
        return [
            [(_s(raw_id), bytes((fields or {}).get(FIELD, b""))) for raw_id, fields in rows]
            for rows in replies
        ]

    async def tail_raw(
        self, positions: Mapping[str, str], *, block_ms: int | None = None, count: int = 500
    ) -> list[RawStreamEntry]:
        items = await self._xread(positions, count=count, block_ms=block_ms)
        return [
            (_s(raw_stream), _s(raw_id), bytes((fields or {}).get(FIELD, b"")))
            for raw_stream, rows in items
            for raw_id, fields in rows
        ]

    async def list_streams(self, pattern: str) -> list[str]:
        found: list[str] = []
        with self._io(f"SCAN {pattern}"):
            async for key in self._r.scan_iter(match=pattern, _type="stream"):
                found.append(_s(key))
        return sorted(found)

    async def stream_length(self, stream: str) -> int:
        with self._io(f"XLEN {stream}"):
            return int(await self._r.xlen(stream))

    # ------------------------------------------------------------------ maintenance

    async def trim_acked(
        self, stream: str, *, before: str | None = None, require: Collection[str] = ()
    ) -> int:
        with self._io(f"XINFO GROUPS {stream}"):
            groups = await self._r.xinfo_groups(stream)
        if not groups or set(require) - {_s(g["name"]) for g in groups}:
            return 0
        floor: tuple[int, int] | None = None
        for g in groups:
            name = _s(g["name"])
            candidates = [parse_id(id_after(_s(g["last-delivered-id"])))]
            with self._io(f"XPENDING {stream} {name}"):
                summary = await self._r.xpending(stream, name)
            if summary["pending"]:
                candidates.append(parse_id(_s(summary["min"])))
            low = min(candidates)
            floor = low if floor is None else min(floor, low)
        assert floor is not None
        if before is not None:
            floor = min(floor, parse_id(before))
        with self._io(f"XTRIM {stream}"):
            n = await self._r.xtrim(stream, minid=format_id(*floor), approximate=False)
        return int(n)

    async def trim_before(self, stream: str, keep_from: str) -> int:
        with self._io(f"XTRIM {stream}"):
            n = await self._r.xtrim(stream, minid=keep_from, approximate=False)
        return int(n)

    async def delete_stream(self, stream: str) -> bool:
        with self._io(f"DEL {stream}"):
            return bool(await self._r.delete(stream))

    async def dead_marks(self) -> set[str]:
        with self._io(f"SMEMBERS {self.names.dead_seen}"):
            return {_s(m) for m in await self._r.smembers(self.names.dead_seen)}

    async def forget_dead_marks(self, marks: Collection[str]) -> int:
        if not marks:
            return 0
        with self._io(f"SREM {self.names.dead_seen}"):
            return int(await self._r.srem(self.names.dead_seen, *marks))

    async def memory_usage(self, key: str) -> int:
        """Bytes Redis holds for ``key`` (0 when absent); not part of the port."""
        with self._io(f"MEMORY USAGE {key}"):
            n = await self._r.memory_usage(key, samples=0)
        return int(n or 0)

    async def write_snapshot(self, name: str, data: bytes) -> None:
        with self._io(f"SET snapshot {name}"):
            await self._r.set(self.names.snapshot(name), data)

    async def read_snapshot(self, name: str) -> bytes | None:
        with self._io(f"GET snapshot {name}"):
            raw = await self._r.get(self.names.snapshot(name))
        return None if raw is None else bytes(raw)

    async def aclose(self) -> None:
        with self._io("close"):
            await self._r.aclose()


def open_log(
    settings: RedisSettings,
    *,
    names: StreamNames | None = None,
    producer: str = "",
    max_deliveries: int = 5,
) -> RedisEventLog:
    """A log on a new client built by :func:`connect`; its ``aclose`` closes it."""
    return RedisEventLog(
        connect(settings),
        names=names,
        producer=producer,
        max_deliveries=max_deliveries,
        block_ms=settings.block_ms,
    )
