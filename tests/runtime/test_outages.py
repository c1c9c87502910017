"""Transport errors are not deliveries: the runtime rides out an unreachable Redis, and
gives up (``OutageExceeded``) only past the outage limit. A real redis-server is restarted
to show that a pooled client carries on without a stale-connection failure."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import LogUnavailable, OutageExceeded
from engine.events import EventLog, RolloutFailed
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer, ride_out
from engine.runtime.loop import serve
from tests.faults.harness import RestartableRedis

S = "rl:test:outage"


def consumer(log: EventLog, name: str = "c1", **kwargs: Any) -> GroupConsumer:
    return GroupConsumer(
        log, group="g", consumer=name, streams=[S], heartbeat_ms=50, claim_idle_ms=400,
        block_ms=50, **kwargs,
    )


def test_a_backoff_with_a_limit_gives_up_once_the_outage_outlasts_it() -> None:
    b = Backoff(first_s=0.01, max_s=0.01, limit_s=0.05)
    b.next_pause("refused")
    time.sleep(0.08)
    with pytest.raises(OutageExceeded, match=r"outage limit of 0.05 s.*refused"):
        b.next_pause("refused")
    b.reset()  # Redis answered: a new outage starts from zero
    assert b.next_pause() == 0.01
    with pytest.raises(ValueError, match="outage limit must be positive"):
        Backoff(limit_s=0)


async def test_ride_out_retries_transport_errors_but_not_refusals() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise LogUnavailable("redis unavailable during XACK: refused")
        return "done"

    assert await ride_out(flaky, Backoff(first_s=0.01, max_s=0.01), what="ack") == "done"
    assert calls == 3

    async def down() -> None:
        raise LogUnavailable("redis unavailable during XADD: refused")

    with pytest.raises(OutageExceeded):
        await ride_out(down, Backoff(first_s=0.01, max_s=0.01, limit_s=0.05), what="flush")


async def _held(log: EventLog, consumer: str = "c1") -> dict[str, int]:
    """The entries ``consumer`` holds in group ``g``, with their delivery counts (read
    without counting a delivery)."""
    return (await log.unread_own_pending("g", consumer, S)).deliveries


async def _delivery_count(log: EventLog, entry_id: str) -> int:
    return (await _held(log))[entry_id]


async def test_a_handler_that_loses_redis_runs_again_without_a_delivery_charged(
    log: EventLog,
) -> None:
    await log.ensure_group(S, "g")
    entry_id = await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.02))
    seen: list[tuple[bool, int]] = []
    stop = asyncio.Event()

    async def handle(d: Delivery) -> None:
        seen.append((d.redelivered, await _delivery_count(log, entry_id)))
        if len(seen) == 1:
            raise LogUnavailable("redis unavailable during XADD: connection reset")
        stop.set()

    served = await asyncio.wait_for(serve(c, stop, handle), 10)
    # Run again as a redelivery (it resumes from the log), still on its first delivery.
    assert seen == [(False, 1), (True, 1)]
    assert served.handled == 1 and served.failed == 0
    assert await log.pending_count(S, "g") == 0


async def test_work_is_released_only_after_its_queued_writes_are_in_redis(
    log: EventLog,
) -> None:
    await log.ensure_group(S, "g")
    await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.02))
    stop = asyncio.Event()
    order: list[str] = []

    async def handle(d: Delivery) -> None:
        raise RuntimeError("agent bug")

    async def settle_writes() -> None:
        order.append(f"flush with {c.in_flight} in flight")
        if len(order) == 1:  # the first flush hits the outage and is retried
            raise LogUnavailable("redis unavailable during pipelined XADD: refused")
        stop.set()

    served = await asyncio.wait_for(serve(c, stop, handle, settle_writes=settle_writes), 10)
    assert order == ["flush with 1 in flight", "flush with 1 in flight"]
    assert served.failed == 1 and c.in_flight == 0


async def test_serve_exits_with_outage_exceeded_when_redis_stays_away(
    log: EventLog,
) -> None:
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.02, limit_s=0.1))
    await c.start()

    async def unreachable(count: int) -> Any:
        raise LogUnavailable("redis unavailable during XREADGROUP g: refused")

    c.fetch = unreachable  # type: ignore[method-assign]

    async def handle(d: Delivery) -> None:
        raise AssertionError("nothing to handle")

    with pytest.raises(OutageExceeded, match="longer than the outage limit"):
        await asyncio.wait_for(serve(c, asyncio.Event(), handle), 10)


async def test_a_stop_while_redis_is_away_at_start_ends_serve_at_once(log: EventLog) -> None:
    """SIGTERM to a process that has not reached Redis yet ends it, not the outage limit."""
    c = consumer(log, backoff=Backoff(first_s=30.0, max_s=30.0, limit_s=300.0))

    async def unreachable() -> None:
        raise LogUnavailable("redis unavailable during XGROUP CREATE g: refused")

    c.start = unreachable  # type: ignore[method-assign]

    async def handle(d: Delivery) -> None:
        raise AssertionError("nothing to handle")

    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.2, stop.set)
    served = await asyncio.wait_for(serve(c, stop, handle), 5)  # not the 30 s pause
    assert served.handled == 0


async def test_a_consumer_claims_nothing_until_owners_have_reasserted_after_an_outage(
    log: EventLog,
) -> None:
    # An owner's entry looks idle after an outage (Redis counts idle time across it); a
    # consumer back from the outage gives the owner a whole claim window to re-assert.
    await log.ensure_group(S, "g")
    await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    await log.read_group("g", "owner", [S], block_ms=10)
    await asyncio.sleep(0.45)  # idle past the claim window, as after an outage
    c = consumer(log, "thief", backoff=Backoff(first_s=0.01, max_s=0.01))
    real_fetch = c.fetch
    down = True

    async def flaky(count: int) -> Any:
        if down:
            raise LogUnavailable("redis unavailable during XREADGROUP g: refused")
        return await real_fetch(count)

    c.fetch = flaky  # type: ignore[method-assign]
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    try:
        await c.start()
        await asyncio.sleep(0.15)  # past the start-up deferral
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])  # the outage
        down = False
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])  # back: no claim yet
        # The owner re-asserts (its heartbeat), so the entry is not idle any more.
        assert await log.keep_alive(S, "g", "owner", [await log.last_id(S)]) == []
        await asyncio.sleep(0.15)
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])
        assert len(await _held(log, "owner")) == 1 and await _held(log, "thief") == {}
    finally:
        stop_wait.cancel()
        await c.aclose()


class _HeartbeatOutage:
    """A log whose keep-alive fails while ``down``: an outage as a consumer that reads
    nothing (every slot busy) sees it, through its heartbeat only."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.down = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    async def keep_alive(self, *args: Any, **kwargs: Any) -> list[str]:
        if self.down:
            raise LogUnavailable("redis unavailable during keep-alive: refused")
        return await self._log.keep_alive(*args, **kwargs)


async def test_a_busy_consumer_whose_heartbeat_failed_claims_nothing_right_after_the_outage(
    log: EventLog,
) -> None:
    await log.ensure_group(S, "g")
    await log.append(S, RolloutFailed(rollout_id="mine", reason="x"))
    flaky = _HeartbeatOutage(log)
    busy = consumer(flaky, "busy")  # type: ignore[arg-type]
    await busy.start()
    try:
        await asyncio.sleep(0.15)  # past the start-up deferral
        [mine], _ = await busy.fetch(1)  # in flight: its heartbeat runs
        await log.append(S, RolloutFailed(rollout_id="theirs", reason="x"))
        [theirs] = await log.read_group("g", "owner", [S], block_ms=10)
        flaky.down = True
        await asyncio.sleep(0.45)  # the owner's entry idles past the window meanwhile
        flaky.down = False
        # Slots free right after the outage, and again four heartbeats later: the owner
        # (slow to come back) keeps its entry for a whole claim window.
        assert await busy.fetch(2) == ([], [])
        await asyncio.sleep(0.2)
        assert await busy.fetch(2) == ([], [])
        assert list(await _held(log, "owner")) == [theirs.id]
        # An owner that never comes back loses it once the window has passed.
        await asyncio.sleep(0.35)
        [claimed], _ = await busy.fetch(2)
        assert claimed.env.id == theirs.id and claimed.redelivered
        assert sorted(await _held(log, "busy")) == sorted([mine.env.id, theirs.id])
    finally:
        await busy.aclose()


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[RestartableRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    server = RestartableRedis(tmp_path)
    server.start()
    yield server
    server.stop()


async def test_pooled_connections_survive_a_redis_restart(restartable: RestartableRedis) -> None:
    client = connect(RedisSettings(url=restartable.url))
    log = RedisEventLog(client)
    try:
        # Fill the pool with several connections, then restart Redis under them.
        await asyncio.gather(*(log.append(S, RolloutFailed(rollout_id=f"r{i}", reason="x"))
                               for i in range(8)))
        restartable.stop()
        await asyncio.sleep(0.6)  # the connections sit idle past the health check
        restartable.start()  # in place: same port, the AOF reloaded
        # Every command after the restart gets through: no stale-connection failure, and
        # the writes are sent once each.
        for i in range(8):
            await log.append(S, RolloutFailed(rollout_id=f"again{i}", reason="x"))
        assert await log.stream_length(S) == 16
    finally:
        await log.aclose()


async def test_entries_a_lost_read_delivered_are_taken_up_without_a_delivery_charged(
    log: EventLog,
) -> None:
    await log.ensure_group(S, "g")
    await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason="x")) for i in (1, 2)])
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.01))
    real_read = log.read_group
    lose_next = True

    async def lossy(*args: Any, **kwargs: Any) -> Any:
        nonlocal lose_next
        got = await real_read(*args, **kwargs)
        if lose_next and got:
            lose_next = False  # Redis delivered; the reply never arrives
            raise LogUnavailable("redis unavailable during XREADGROUP g: connection reset")
        return got

    log.read_group = lossy  # type: ignore[method-assign]
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    try:
        await c.start()
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])  # the lost reply
        fetched = await c.fetch_or_stop(10, stop_wait)
        assert fetched is not None
        deliveries, _dead = fetched
        # Both come back at once (no idle window), still on their first delivery.
        assert sorted(d.env.event.rollout_id for d in deliveries) == ["r1", "r2"]  # type: ignore[attr-defined]
        assert [d.deliveries for d in deliveries] == [1, 1]
        for d in deliveries:
            assert await _delivery_count(log, d.env.id) == 1
        # A delivery released on purpose (its work failed) is not taken up that way: it
        # waits for a claim, which counts.
        c.release(deliveries[0])
        await c.ack(deliveries[1])
        c._recheck_own = True  # as after another failed read
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_work_whose_lease_another_consumer_took_is_stopped_here(
    log: EventLog,
) -> None:
    await log.ensure_group(S, "g")
    entry_id = await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.01))
    stop = asyncio.Event()
    running = asyncio.Event()
    cancelled: list[str] = []

    async def handle(d: Delivery) -> None:
        running.set()
        try:
            await asyncio.Event().wait()  # a long episode
        except asyncio.CancelledError:
            cancelled.append(d.env.id)
            raise

    served_task = asyncio.create_task(serve(c, stop, handle))
    await asyncio.wait_for(running.wait(), 10)
    # This consumer stalled past the idle window and another one claimed the entry.
    taken = await log.claim_idle(S, "g", "thief", min_idle_ms=0)
    assert [e.id for e in taken.entries] == [entry_id]
    for _ in range(200):
        if cancelled:
            break
        await asyncio.sleep(0.02)
    assert cancelled == [entry_id]  # stopped by the heartbeat that found the lease gone
    stop.set()
    served = await asyncio.wait_for(served_task, 10)
    assert served.failed == 1 and served.handed_back == 0
    # nothing given back over its head
    assert list(await _held(log, "thief")) == [entry_id] and await _held(log) == {}


async def test_nothing_is_claimed_until_a_restarted_redis_has_been_up_a_whole_window(
    restartable: RestartableRedis,
) -> None:
    # Redis keeps an entry's idle time across a restart, so right after one every live
    # owner's entries look idle; a consumer that never saw the outage (one started just
    # then) must not take them before their owners have had a window to renew them.
    log = RedisEventLog(connect(RedisSettings(url=restartable.url)))
    try:
        await log.ensure_group(S, "g")
        await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
        [held] = await log.read_group("g", "owner", [S], block_ms=10)
        await asyncio.sleep(0.5)  # idle past the window
        restartable.stop()
        restartable.start()
        assert (await log.claim_idle(S, "g", "fresh", min_idle_ms=400)).entries == []
        assert list(await _held(log, "owner")) == [held.id]
        # What an owner handed back nobody renews: that is claimable at once all the same.
        await log.append(S, RolloutFailed(rollout_id="back", reason="x"))
        [back] = await log.read_group("g", "stopping", [S], block_ms=10)
        assert await log.hand_back(S, "g", "stopping", [back.id]) == []
        [taken] = (await log.claim_idle(S, "g", "fresh", min_idle_ms=400)).entries
        assert taken.id == back.id
        await log.ack(S, "g", back.id)
        await asyncio.sleep(2.1)  # up a window (and INFO's whole second) since; no renewal
        claimed = await log.claim_idle(S, "g", "fresh", min_idle_ms=400)
        assert [e.id for e in claimed.entries] == [held.id]
    finally:
        await log.aclose()
