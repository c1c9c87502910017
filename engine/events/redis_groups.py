"""The consumer-group half of the Redis log: delivery, acks, leases, claims, dead letters.

``keep_alive`` and ``hand_back`` check that the consumer still owns an entry in the same
script as the refresh: a plain XCLAIM would take back an entry another consumer had rightly
claimed from a stalled one, and both would run the same work.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any

from redis.asyncio.cluster import RedisCluster

from engine.errors import LogError, LogUnavailable
from engine.events import redis_scripts as lua
from engine.events.base import Envelope
from engine.events.ids import EMPTY_ID
from engine.events.log import ClaimResult
from engine.events.log_base import HAND_BACK_IDLE_MS, LogBase, Row, _s
from engine.events.names import StreamNames
from engine.events.redis_connect import RedisClient, endpoint_of, translate

__all__ = ["RedisGroups"]


def _missing(exc: LogError) -> bool:
    text = str(exc).lower()
    return "nogroup" in text or "no such key" in text


def _rows_of(reply: Any) -> list[tuple[Any, list[Row]]]:
    """``(stream, rows)`` pairs of an XREAD or XREADGROUP reply, RESP2 or RESP3 shaped."""
    if isinstance(reply, dict):
        return [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in reply.items()]
    return list(reply or [])


class RedisGroups(LogBase):
    """The client, the scripts and the consumer-group methods of ``RedisEventLog``."""

    def __init__(
        self,
        redis: RedisClient,
        *,
        names: StreamNames | None = None,
        producer: str = "",
        max_deliveries: int = 5,
        block_ms: int = 2000,
    ) -> None:
        super().__init__(
            names=names, producer=producer, max_deliveries=max_deliveries, block_ms=block_ms
        )
        self.redis = redis
        # redis-py's stubs for stream replies are inexact; replies are checked where
        # they are decoded.
        self._r: Any = redis
        self.endpoint = endpoint_of(redis)
        self.cluster = isinstance(redis, RedisCluster)
        self._cas = self._r.register_script(lua.CAS)
        self._keep_alive = self._r.register_script(lua.KEEP_ALIVE)
        self._hand_back = self._r.register_script(lua.HAND_BACK)
        self._dead_script = self._r.register_script(lua.DEAD_LETTER)
        self._once = self._r.register_script(lua.ONCE)
        self._no_uptime = False

    def _io(self, what: str) -> AbstractContextManager[None]:
        return translate(what, self.endpoint)

    async def ensure_group(self, stream: str, group: str, *, start: str = "0") -> None:
        try:
            with self._io(f"XGROUP CREATE {stream} {group}"):
                await self._r.xgroup_create(stream, group, id=start, mkstream=True)
        except LogError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Envelope]:
        block = self.block_ms if block_ms is None else block_ms
        with self._io(f"XREADGROUP {group}"):
            result = await self._r.xreadgroup(
                group, consumer, dict.fromkeys(streams, ">"), count=count, block=block or None
            )
        out: list[Envelope] = []
        for raw_stream, rows in _rows_of(result):
            out.extend(await self._decode_rows(_s(raw_stream), rows, group=group))
        return out

    async def ack(self, stream: str, group: str, *ids: str) -> int:
        if not ids:
            return 0
        with self._io(f"XACK {stream} {group}"):
            n = await self._r.xack(stream, group, *ids)
        return int(n)

    async def keep_alive(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        if not ids:
            return []
        with self._io(f"keep-alive on {stream} {group}"):
            lost = await self._keep_alive(keys=[stream], args=[group, consumer, *ids])
        return [_s(i) for i in lost]

    async def hand_back(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        if not ids:
            return []
        with self._io(f"hand-back on {stream} {group}"):
            lost = await self._hand_back(
                keys=[stream], args=[group, consumer, HAND_BACK_IDLE_MS, *ids]
            )
        return [_s(i) for i in lost]

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
        up_ms = await self._up_ms()
        if up_ms is not None and up_ms < min_idle_ms + 1000:  # INFO counts whole seconds
            min_idle_ms = HAND_BACK_IDLE_MS  # only what was handed back: nobody renews it
        start = EMPTY_ID
        rows: list[Row] = []
        while len(rows) < count:
            with self._io(f"XAUTOCLAIM {stream} {group}"):
                reply = await self._r.xautoclaim(
                    stream, group, consumer, min_idle_ms, start_id=start, count=count - len(rows)
                )
            next_start, claimed = _s(reply[0]), reply[1]
            rows.extend(claimed)
            if len(reply) > 2 and reply[2]:
                # Entries deleted from the stream while pending: nothing to run.
                await self.ack(stream, group, *(_s(i) for i in reply[2]))
            if next_start == EMPTY_ID:
                break
            start = next_start
        return await self._check_deliveries(stream, group, rows, ack_dead=ack_dead)

    async def _up_ms(self) -> int | None:
        """How long the server has been up (the least of a cluster's nodes), from ``INFO
        server``; None where it does not say (fakeredis), asked once."""
        if self._no_uptime:
            return None
        try:
            with self._io("INFO server"):
                info = await self._r.info("server")
        except LogUnavailable:
            raise
        except LogError:
            info = {}
        nodes = [info] if "uptime_in_seconds" in info else list(info.values())
        ups = [int(n["uptime_in_seconds"]) for n in nodes
               if isinstance(n, dict) and "uptime_in_seconds" in n]
        if not ups:
            self._no_uptime = True
            return None
        return min(ups) * 1000

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
        """Re-reading counts a delivery (XREADGROUP from 0)."""
        with self._io(f"XREADGROUP {group} (pending)"):
            result = await self._r.xreadgroup(group, consumer, {stream: "0"}, count=count)
        rows = [row for _stream, part in _rows_of(result) for row in part]
        if not limit:
            return ClaimResult(entries=await self._decode_rows(stream, rows, group=group))
        return await self._check_deliveries(stream, group, rows, ack_dead=ack_dead)

    async def _check_deliveries(
        self, stream: str, group: str, rows: list[Row], *, ack_dead: bool
    ) -> ClaimResult:
        if not rows:
            return ClaimResult()
        with self._io(f"XPENDING {stream} {group}"):
            async with self._r.pipeline(transaction=False) as pipe:
                for raw_id, _fields in rows:
                    pipe.xpending_range(stream, group, min=raw_id, max=raw_id, count=1)
                pend = await pipe.execute()
        times = {
            _s(raw_id): int(info[0]["times_delivered"])
            for (raw_id, _fields), info in zip(rows, pend, strict=True)
            if info
        }
        return await self._split_deliveries(stream, group, rows, times, ack_dead=ack_dead)

    async def unread_own_pending(
        self, group: str, consumer: str, stream: str, *, skip: Collection[str] = ()
    ) -> ClaimResult:
        """XPENDING, then XRANGE of each: neither touches the delivery count."""
        skipped = set(skip)
        with self._io(f"XPENDING {stream} {group} {consumer}"):
            pend = await self._r.xpending_range(
                stream, group, min="-", max="+", count=10_000, consumername=consumer
            )
        wanted = [(_s(p["message_id"]), int(p["times_delivered"])) for p in pend]
        wanted = [(i, n) for i, n in wanted if i not in skipped]
        result = ClaimResult()
        if not wanted:
            return result
        with self._io(f"XRANGE {stream} (own pending)"):
            async with self._r.pipeline(transaction=False) as pipe:
                for entry_id, _n in wanted:
                    pipe.xrange(stream, entry_id, entry_id, count=1)
                replies = await pipe.execute()
        rows: list[Row] = []
        for (entry_id, times), reply in zip(wanted, replies, strict=True):
            result.deliveries[entry_id] = times
            rows.append((entry_id, reply[0][1] if reply else None))
        result.entries = await self._decode_rows(stream, rows, group=group)
        return result

    async def pending_count(self, stream: str, group: str) -> int:
        with self._io(f"XPENDING {stream} {group}"):
            info = await self._r.xpending(stream, group)
        return int(info["pending"])

    async def group_consumers(self, stream: str, group: str) -> dict[str, int]:
        try:
            with self._io(f"XINFO CONSUMERS {stream} {group}"):
                rows = await self._r.xinfo_consumers(stream, group)
        except LogError as exc:
            if isinstance(exc, LogUnavailable) or not _missing(exc):
                raise
            return {}
        return {_s(row["name"]): int(row["idle"]) for row in rows}
