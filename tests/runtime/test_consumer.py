"""GroupConsumer: fetching until a stop, failed reads and their backoff, dead entries held
until settled."""

from __future__ import annotations

import asyncio

from engine.errors import LogUnavailable
from engine.events import EventLog, RolloutFailed
from engine.events.log import DeadEntry
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer
from engine.runtime.loop import HandBack, LeaseLost, serve

S = "rl:test:consumer"


async def pending(log: EventLog, *consumers: str) -> dict[str, int]:
    """The entries of group ``g`` these consumers hold, with their delivery counts (read
    without counting a delivery)."""
    out: dict[str, int] = {}
    for name in consumers:
        out.update((await log.unread_own_pending("g", name, S)).deliveries)
    return out


def consumer(log: EventLog, name: str = "c1", **kwargs: object) -> GroupConsumer:
    return GroupConsumer(
        log, group="g", consumer=name, streams=[S], heartbeat_ms=50, claim_idle_ms=400,
        block_ms=100, **kwargs,  # type: ignore[arg-type]
    )


async def test_fetch_or_stop_hands_out_new_entries(log: EventLog) -> None:
    c = consumer(log)
    await c.start()
    await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    try:
        fetched = await c.fetch_or_stop(10, stop_wait)
        assert fetched is not None
        deliveries, dead = fetched
        assert [d.env.event.type for d in deliveries] == ["RolloutFailed"] and dead == []
        await c.ack(deliveries[0])
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_fetch_or_stop_returns_none_once_stopped(log: EventLog) -> None:
    c = consumer(log)
    await c.start()
    stop = asyncio.Event()
    stop_wait = asyncio.create_task(stop.wait())
    try:
        pending = asyncio.create_task(c.fetch_or_stop(10, stop_wait))
        await asyncio.sleep(0.05)  # blocked: nothing to read
        stop.set()
        assert await asyncio.wait_for(pending, 5) is None
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_a_failed_read_comes_back_empty_after_a_pause(log: EventLog) -> None:
    # The first pause is 0.2 s; the next one (30 s) is cut short by the stop.
    c = consumer(log, backoff=Backoff(first_s=0.2, factor=150, max_s=30))
    calls = 0

    async def unavailable(count: int) -> object:
        nonlocal calls
        calls += 1
        raise LogUnavailable("redis unavailable during XREADGROUP g: refused")

    c.fetch = unavailable  # type: ignore[method-assign,assignment]
    stop = asyncio.Event()
    stop_wait = asyncio.create_task(stop.wait())
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])
        assert loop.time() - t0 >= 0.19 and calls == 1
        stop.set()  # a stop cuts the pause short
        t0 = loop.time()
        assert await c.fetch_or_stop(10, stop_wait) == ([], [])
        assert loop.time() - t0 < 5
    finally:
        stop_wait.cancel()


async def test_dead_entries_are_held_until_settled(log: EventLog) -> None:
    log.max_deliveries = 1
    await log.ensure_group(S, "g")
    await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
    await log.read_group("g", "gone", [S], block_ms=50)  # delivery 1, then its reader dies
    await asyncio.sleep(0.45)
    c = consumer(log, "c2", ack_dead=False)
    await c.start()
    await asyncio.sleep(0.15)  # a new consumer claims only after two heartbeats (50 ms)
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    try:
        fetched = await c.fetch_or_stop(10, stop_wait)
        assert fetched is not None
        deliveries, dead = fetched
        assert deliveries == [] and [d.deliveries for d in dead] == [2]
        await asyncio.sleep(0.6)  # past the idle window: the heartbeat keeps it ours
        assert (await log.claim_idle(S, "g", "thief", min_idle_ms=400)).dead == []
        assert await log.pending_count(S, "g") == 1
        await c.settle(dead[0])
        assert await log.pending_count(S, "g") == 0
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_handle_dead_settles_after_the_handler_and_leaves_failures_pending(
    log: EventLog,
) -> None:
    log.max_deliveries = 1
    await log.ensure_group(S, "g")
    await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason="x")) for i in (1, 2)])
    await log.read_group("g", "gone", [S], block_ms=50)
    await asyncio.sleep(0.45)
    c = consumer(log, "c3", ack_dead=False)
    await c.start()
    await asyncio.sleep(0.15)  # a new consumer claims only after two heartbeats (50 ms)
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    seen: list[str] = []

    async def handler(entry: DeadEntry) -> None:
        assert isinstance(entry.event, RolloutFailed)
        seen.append(entry.event.rollout_id)
        if entry.event.rollout_id == "r2":
            raise LogUnavailable("redis unavailable during XADD: refused")

    try:
        fetched = await c.fetch_or_stop(10, stop_wait)
        assert fetched is not None and len(fetched[1]) == 2
        await c.handle_dead(fetched[1], handler)
        assert seen == ["r1", "r2"]
        # r1 is settled; r2 stays pending, no longer kept alive, for a later claim
        assert await log.pending_count(S, "g") == 1
        await asyncio.sleep(0.45)
        again = await log.claim_idle(S, "g", "c4", min_idle_ms=400)
        assert [d.event.rollout_id for d in again.dead] == ["r2"]  # type: ignore[union-attr]
    finally:
        stop_wait.cancel()
        await c.aclose()


def test_backoff_grows_to_its_cap_and_resets_on_success() -> None:
    b = Backoff(first_s=0.5, max_s=3.0)
    assert [b.next_pause() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next_pause() == 0.5
    for _ in range(10_000):  # no overflow however long Redis stays away
        b.next_pause()
    assert b.next_pause() == 3.0


async def test_reads_back_off_while_redis_is_away_and_reset_once_it_is_back(
    log: EventLog,
) -> None:
    c = consumer(log, backoff=Backoff(first_s=0.01, max_s=0.04))
    await c.start()
    real_fetch = c.fetch
    failing = 3

    async def flaky(count: int) -> object:
        nonlocal failing
        if failing:
            failing -= 1
            raise LogUnavailable("redis unavailable during XREADGROUP g: refused")
        return await real_fetch(count)

    c.fetch = flaky  # type: ignore[method-assign,assignment]
    stop_wait = asyncio.create_task(asyncio.Event().wait())
    try:
        for _ in range(3):
            assert await c.fetch_or_stop(10, stop_wait) == ([], [])
        assert c.backoff.failures == 3
        await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
        fetched = await c.fetch_or_stop(10, stop_wait)
        assert fetched is not None and len(fetched[0]) == 1
        assert c.backoff.failures == 0
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_a_stop_during_a_read_hands_back_what_it_delivered(log: EventLog) -> None:
    # The stop does not cancel the read: the entry it delivers is handed back (claimable
    # at once, and not counted as a delivery) instead of stranded until the idle window.
    c = consumer(log)
    await c.start()
    stop = asyncio.Event()
    stop_wait = asyncio.create_task(stop.wait())
    real_fetch = c.fetch

    async def slow(count: int) -> object:
        stop.set()
        await log.append(S, RolloutFailed(rollout_id="r", reason="x"))
        return await real_fetch(count)

    c.fetch = slow  # type: ignore[method-assign,assignment]
    try:
        assert await c.fetch_or_stop(10, stop_wait) is None
        assert list((await pending(log, "c1")).values()) == [0]
        taken = await log.claim_idle(S, "g", "peer", min_idle_ms=60_000)
        assert [e.event.type for e in taken.entries] == ["RolloutFailed"]
    finally:
        stop_wait.cancel()
        await c.aclose()


async def test_serve_acks_returns_releases_failures_and_hands_back_on_stop(
    log: EventLog,
) -> None:
    # r-ok is handled (acked); r-bad raises (left pending, as a further delivery after the
    # idle window); r-slow is still running at the stop (cancelled past the grace period)
    # and r-back gives up itself with HandBack: both are handed back, not charged.
    for rid in ("r-ok", "r-bad", "r-slow", "r-back"):
        await log.append(S, RolloutFailed(rollout_id=rid, reason="x"))
    c = consumer(log)
    stop = asyncio.Event()
    seen: list[str] = []
    running = 0
    peak = 0

    async def handle(d: Delivery) -> None:
        nonlocal running, peak
        ev = d.env.event
        assert isinstance(ev, RolloutFailed)
        running += 1
        peak = max(peak, running)
        seen.append(ev.rollout_id)
        try:
            if ev.rollout_id == "r-bad":
                raise ValueError("boom")
            if ev.rollout_id == "r-slow":
                stop.set()
                await asyncio.Event().wait()
            if ev.rollout_id == "r-back":
                raise HandBack
        finally:
            running -= 1

    served = await asyncio.wait_for(serve(c, stop, handle, capacity=2, grace_s=0.05), 10)
    assert peak <= 2 and (served.handled, served.failed) == (1, 1)
    held = await pending(log, "c1")
    ids = {env.event.rollout_id: env.id for env in await log.read_all(S)}  # type: ignore[attr-defined]
    assert ids["r-ok"] not in held and held[ids["r-bad"]] == 1
    handed = [rid for rid in ("r-slow", "r-back") if rid in seen]
    assert handed and served.handed_back == len(handed)
    for rid in handed:
        assert held[ids[rid]] == 0


async def test_work_is_not_handed_back_while_its_events_may_still_be_unwritten(
    log: EventLog,
) -> None:
    # The stop's last flush (before_hand_back) fails: events of the unfinished entry may still
    # sit in the appender, so handing it back would let another consumer run it beside our
    # late writes. It stays pending as a delivery, claimable only after the idle window.
    await log.append(S, RolloutFailed(rollout_id="r-unwritten", reason="x"))
    c = consumer(log)
    stop = asyncio.Event()

    async def handle(d: Delivery) -> None:
        stop.set()
        raise HandBack

    async def flush_fails() -> None:
        raise LogUnavailable("redis at 127.0.0.1:1 is unreachable (test)")

    await asyncio.wait_for(serve(c, stop, handle, before_hand_back=flush_fails), 10)
    (entry,) = await log.read_all(S)
    held = await pending(log, "c1")
    assert held[entry.id] == 1, "handed back (delivery count reset) despite unwritten events"

    # Control: the same stop with a flush that succeeds hands it back (count reset to 0).
    await log.append(S, RolloutFailed(rollout_id="r-written", reason="x"))
    stop = asyncio.Event()

    async def flush_ok() -> None:
        return None

    await asyncio.wait_for(serve(consumer(log, "c2"), stop, handle, before_hand_back=flush_ok), 10)
    written = (await log.read_all(S))[-1]
    assert (await pending(log, "c2"))[written.id] == 0


T = "rl:test:consumer-b"


async def test_an_entry_waiting_in_the_backlog_is_kept_alive(log: EventLog) -> None:
    # A group read over two streams delivers one entry per stream; a fetch of one hands out
    # one of them. The other waits in the backlog for a free slot, and the heartbeat keeps
    # it alive: past the idle window another consumer's claim finds nothing to take.
    await log.append(S, RolloutFailed(rollout_id="r-s", reason="x"))
    await log.append(T, RolloutFailed(rollout_id="r-t", reason="x"))
    c = GroupConsumer(log, group="g", consumer="c1", streams=[S, T], heartbeat_ms=50,
                      claim_idle_ms=400, block_ms=100)
    await c.start()
    try:
        out, _ = await c.fetch(1)
        assert len(out) == 1 and c.in_flight == 1
        await asyncio.sleep(0.6)  # past the idle window, the slot still busy
        for stream in (S, T):
            assert (await log.claim_idle(stream, "g", "thief", min_idle_ms=400)).entries == []
        await c.ack(out[0])
        (waiting,), _ = await c.fetch(1)
        assert waiting.env.stream != out[0].env.stream and not waiting.redelivered
    finally:
        await c.aclose()


async def test_a_backlog_entry_claimed_away_is_dropped_not_run(log: EventLog) -> None:
    # The consumer could not keep its backlog alive (it stalled past the idle window) and
    # another consumer claimed the waiting entry: the next heartbeat drops it, so it never
    # runs here beside its new owner.
    await log.append(S, RolloutFailed(rollout_id="r-s", reason="x"))
    await log.append(T, RolloutFailed(rollout_id="r-t", reason="x"))
    c = GroupConsumer(log, group="g", consumer="c1", streams=[S, T], heartbeat_ms=50,
                      claim_idle_ms=400, block_ms=100)
    await c.ensure_groups()
    out, _ = await c.fetch(1)  # no heartbeat running: the consumer is stalled
    other = T if out[0].env.stream == S else S
    await asyncio.sleep(0.45)
    assert len((await log.claim_idle(other, "g", "thief", min_idle_ms=400)).entries) == 1
    await c.start()  # the heartbeat runs again
    try:
        await asyncio.sleep(0.15)
        await c.ack(out[0])
        assert await c.fetch(1) == ([], [])
    finally:
        await c.aclose()


async def test_a_handler_that_lost_its_lease_is_neither_acked_nor_released(
    log: EventLog,
) -> None:
    await log.append(S, RolloutFailed(rollout_id="r-stale", reason="x"))
    c = consumer(log)
    stop = asyncio.Event()

    async def handle(d: Delivery) -> None:
        stop.set()
        raise LeaseLost("taken over under a newer lease")

    served = await asyncio.wait_for(serve(c, stop, handle), 10)
    assert (served.handled, served.failed, served.handed_back) == (0, 1, 0)
    (entry,) = await log.read_all(S)
    assert (await pending(log, "c1"))[entry.id] == 1  # still pending: not acked
