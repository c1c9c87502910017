"""EventLog contract: every test runs on each implementation of the port, the memory log,
the Redis adapter on fakeredis and on a real redis-server (``make_log``, ``log``: see the
conftests). Entries a broken writer leaves are stored with ``write_raw``. The last tests are
the Redis adapter's own (its client, its translation of redis errors)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from engine.errors import AppendConflict, LogError, LogUnavailable
from engine.events import DeadLetter, EventLog, RolloutFailed, SampleCompleted, encode
from engine.events.redis_log import RedisEventLog, RedisSettings, open_log
from tests.conftest import ClientFactory, LogFactory, write_raw
from tests.events.examples import example_events

S = "rl:{test}"  # one hash tag: the streams derived from it share a cluster slot


def failed(i: int) -> RolloutFailed:
    return RolloutFailed(rollout_id=f"r{i}", reason=str(i))


async def test_append_read_preserves_order_and_ids(log: EventLog) -> None:
    ids = [await log.append(S, failed(i)) for i in range(20)]
    envs = await log.read(S)
    assert [e.id for e in envs] == ids
    assert [e.event for e in envs] == [failed(i).model_copy(update={"producer": "test"})
                                       for i in range(20)]
    assert await log.last_id(S) == ids[-1]


async def test_append_many_across_streams_in_order(log: EventLog) -> None:
    items = [(f"{S}:{i % 3}", failed(i)) for i in range(30)]
    ids = await log.append_many(items)
    assert len(ids) == 30
    for k in range(3):
        got = await log.read(f"{S}:{k}")
        assert [e.event.rollout_id for e in got] == [f"r{i}" for i in range(k, 30, 3)]


async def test_every_event_type_round_trips_through_redis(log: EventLog) -> None:
    events = example_events()
    await log.append_many([(S, e) for e in events])
    got = [e.event for e in await log.read(S)]
    assert got == [e.model_copy(update={"producer": "test"}) for e in events]


async def test_causation_and_producer_recorded(log: EventLog) -> None:
    await log.append(S, failed(0))
    first = (await log.read(S))[0]
    await log.append(S, failed(1), causation=first)
    second = (await log.read(S))[1]
    assert second.event.causation == f"{S}@{first.id}"
    assert second.event.producer == "test"


async def test_read_all_pages_and_resumes_after_position(log: EventLog) -> None:
    ids = await log.append_many([(S, failed(i)) for i in range(25)])
    assert len(await log.read_all(S, page=7)) == 25
    tail = await log.read_all(S, after=ids[9], page=4)
    assert [e.id for e in tail] == ids[10:]


async def test_64k_token_payload(log: EventLog) -> None:
    n = 65536
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=list(range(100)),
                         response_ids=[i % 50000 for i in range(n)], logprobs=[-0.5] * n,
                         loss_mask=[1] * n)
    await log.append(S, ev)
    (env,) = await log.read(S)
    assert isinstance(env.event, SampleCompleted)
    assert env.event.response_ids == ev.response_ids
    assert len(env.event.logprobs) == n


async def test_range_bounds_read_as_xrange_reads_them(log: EventLog) -> None:
    ids = [await write_raw(log, S, {b"e": encode(failed(i))}, f"{ms}-{seq}")
           for i, (ms, seq) in enumerate([(5, 0), (5, 1), (7, 0), (9, 3)])]

    async def span(start: str, end: str, count: int | None = None) -> list[str]:
        return [e.id for e in await log.read(S, start, end, count)]

    assert await span("-", "+") == ids
    assert await span(f"({ids[0]}", "+") == ids[1:]
    assert await span("5", "5") == ids[:2]  # a bare <ms>: its first id as a start, last as end
    assert await span("(5", "(9") == ids[1:]  # up to 9-MAX, exclusive
    assert await span("(5", f"({ids[3]}") == ids[1:3]
    assert await span(ids[1], ids[2]) == ids[1:3]
    assert await span("-", "+", 3) == ids[:3]
    assert await span("8", "+") == [ids[3]]
    assert await span("9-4", "+") == []
    assert [rows for rows in await log.read_raw_ranges(S, [("(5-1", "9", 1)])] == [
        [(ids[2], encode(failed(2)))]
    ]


async def test_compare_and_append(log: EventLog) -> None:
    first = await log.append_if_last(S, failed(0), "0-0")
    with pytest.raises(AppendConflict) as info:
        await log.append_if_last(S, failed(1), "0-0")
    assert info.value.current == first[0]
    ids = await log.append_if_last(S, [failed(1), failed(2)], first[0])
    assert len(ids) == 2
    assert await log.last_id(S) == ids[-1]
    assert len(await log.read(S)) == 3


async def test_compare_and_append_with_follow_ups_is_atomic(log: EventLog) -> None:
    ids = await log.append_if_last(S, failed(0), "0-0", also=[(f"{S}:a", failed(1)),
                                                             (f"{S}:b", failed(2))])
    assert len(ids) == 3
    assert [e.event.rollout_id for e in await log.read(f"{S}:a")] == ["r1"]  # type: ignore[attr-defined]
    with pytest.raises(AppendConflict):
        await log.append_if_last(S, failed(3), "0-0", also=[(f"{S}:a", failed(4))])
    assert len(await log.read(f"{S}:a")) == 1  # the follow-up was not written either


async def test_concurrent_writers_racing_cas_lose_nothing(make_log: LogFactory) -> None:
    writers, per_writer = 6, 15

    async def writer(w: int) -> int:
        log = make_log(producer=f"w{w}")
        conflicts = 0
        for k in range(per_writer):
            while True:
                last = await log.last_id(S)
                await asyncio.sleep(0)  # give the others a chance to interleave
                try:
                    await log.append_if_last(S, RolloutFailed(rollout_id=f"w{w}", reason=str(k)),
                                             last)
                    break
                except AppendConflict:
                    conflicts += 1
        return conflicts

    conflicts = await asyncio.gather(*(writer(w) for w in range(writers)))
    log = make_log()
    events = [e.event for e in await log.read(S)]
    assert len(events) == writers * per_writer
    seen = {(e.rollout_id, e.reason) for e in events if isinstance(e, RolloutFailed)}
    assert len(seen) == writers * per_writer
    for w in range(writers):  # each writer's own appends stay in its order
        mine = [int(e.reason) for e in events if isinstance(e, RolloutFailed)
                and e.rollout_id == f"w{w}"]
        assert mine == list(range(per_writer))
    assert sum(conflicts) > 0  # the race was real


async def test_tail_and_subscribe_see_new_events(log: EventLog) -> None:
    await log.append(S, failed(0))
    got: list[str] = []

    async def consume() -> None:
        async for env in log.subscribe(S, block_ms=100):
            got.append(env.event.rollout_id)  # type: ignore[attr-defined]
            if len(got) == 3:
                return

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    for i in (1, 2, 3):
        await log.append(S, failed(i))
    await asyncio.wait_for(task, 10)
    assert got == ["r1", "r2", "r3"]
    last = await log.last_id(S)
    assert await log.tail({S: last}, block_ms=50) == []


async def test_group_create_is_idempotent_and_delivers_once(log: EventLog) -> None:
    await log.ensure_group(S, "g")
    await log.ensure_group(S, "g")
    await log.append_many([(S, failed(i)) for i in range(5)])
    a = await log.read_group("g", "c1", [S], count=3, block_ms=50)
    b = await log.read_group("g", "c2", [S], count=10, block_ms=50)
    assert len(a) == 3 and len(b) == 2
    assert {e.id for e in a}.isdisjoint({e.id for e in b})
    assert await log.read_group("g", "c1", [S], count=10, block_ms=50) == []


async def test_restart_rereads_own_pending_then_ack(make_log: LogFactory) -> None:
    log = make_log()
    await log.ensure_group(S, "g")
    await log.append_many([(S, failed(i)) for i in range(3)])
    got = await log.read_group("g", "worker-1", [S], block_ms=50)
    await log.ack(S, "g", got[0].id)
    restarted = make_log()  # same consumer name, new process
    pending = (await restarted.read_own_pending("g", "worker-1", S, limit=False)).entries
    assert [e.id for e in pending] == [e.id for e in got[1:]]
    await restarted.ack(S, "g", *(e.id for e in pending))
    assert (await restarted.read_own_pending("g", "worker-1", S, limit=False)).entries == []
    assert await restarted.pending_count(S, "g") == 0


async def test_claim_after_consumer_dies(make_log: LogFactory) -> None:
    dead = make_log()
    await dead.ensure_group(S, "g")
    await dead.append_many([(S, failed(i)) for i in range(4)])
    taken = await dead.read_group("g", "dead", [S], block_ms=50)
    assert len(taken) == 4
    live = make_log()
    assert (await live.claim_idle(S, "g", "live", min_idle_ms=60_000)).entries == []
    await asyncio.sleep(0.15)
    claimed = await live.claim_idle(S, "g", "live", min_idle_ms=100)
    assert [e.id for e in claimed.entries] == [e.id for e in taken]
    assert all(n == 2 for n in claimed.deliveries.values())
    await live.ack(S, "g", *(e.id for e in claimed.entries))
    assert await live.pending_count(S, "g") == 0


async def test_keep_alive_protects_live_work(make_log: LogFactory) -> None:
    worker = make_log()
    await worker.ensure_group(S, "g")
    await worker.append(S, failed(0))
    (env,) = await worker.read_group("g", "w", [S], block_ms=50)
    await asyncio.sleep(0.15)
    await worker.keep_alive(S, "g", "w", [env.id])
    other = make_log()
    assert (await other.claim_idle(S, "g", "o", min_idle_ms=100)).entries == []


async def test_keep_alive_never_takes_back_a_claimed_entry(
    make_log: LogFactory,
) -> None:
    stalled = make_log()
    await stalled.ensure_group(S, "g")
    await stalled.append_many([(S, failed(0)), (S, failed(1))])
    taken = await stalled.read_group("g", "stalled", [S], block_ms=50)
    await asyncio.sleep(0.15)
    rescuer = make_log()
    claimed = await rescuer.claim_idle(S, "g", "rescuer", min_idle_ms=100, count=1)
    assert [e.id for e in claimed.entries] == [taken[0].id]
    lost = await stalled.keep_alive(S, "g", "stalled", [e.id for e in taken])
    assert lost == [taken[0].id]  # the stalled worker learns it no longer owns it
    assert await rescuer.keep_alive(S, "g", "rescuer", [taken[0].id]) == []  # not taken back
    assert await stalled.keep_alive(S, "g", "stalled", [taken[1].id]) == []  # still its own
    third = make_log()  # both were just refreshed: nothing is idle past the window
    assert (await third.claim_idle(S, "g", "third", min_idle_ms=100)).entries == []
    await rescuer.ack(S, "g", taken[0].id)
    assert await stalled.keep_alive(S, "g", "stalled", [taken[0].id]) == [taken[0].id]


async def test_too_many_deliveries_go_to_dead_letters(make_log: LogFactory) -> None:
    log = make_log(max_deliveries=2)
    await log.ensure_group(S, "g")
    await log.append(S, failed(7))
    await log.read_group("g", "a", [S], block_ms=50)  # delivery 1
    await asyncio.sleep(0.03)
    first = await log.claim_idle(S, "g", "b", min_idle_ms=20)  # delivery 2
    assert len(first.entries) == 1 and not first.dead
    await asyncio.sleep(0.03)
    second = await log.claim_idle(S, "g", "c", min_idle_ms=20)  # delivery 3 > limit
    assert second.entries == []
    assert len(second.dead) == 1
    assert second.dead[0].event == failed(7)
    assert await log.pending_count(S, "g") == 0
    (letter,) = await log.read(log.names.dead)
    assert isinstance(letter.event, DeadLetter)
    assert letter.event.source_id == second.dead[0].id
    assert letter.event.deliveries == 3
    assert "delivered 3 times" in letter.event.error
    assert log.dead_lettered == 1


async def test_dead_entries_can_stay_pending_until_the_caller_settles(
    make_log: LogFactory,
) -> None:
    # ack_dead=False: the entry is dead-lettered but stays pending, owned by the claimer,
    # until it acks; if the claimer dies first, the next claim hands it out as dead again
    # (to be aborted again), but the dead-letter stream keeps one letter for it.
    log = make_log(max_deliveries=1)
    await log.ensure_group(S, "g")
    await log.append(S, failed(3))
    await log.read_group("g", "a", [S], block_ms=50)  # delivery 1
    await asyncio.sleep(0.03)
    first = await log.claim_idle(S, "g", "b", min_idle_ms=20, ack_dead=False)
    assert first.entries == [] and [d.event for d in first.dead] == [failed(3)]
    assert await log.pending_count(S, "g") == 1
    # "b" dies before acking; "c" claims it later
    await asyncio.sleep(0.03)
    again = await log.claim_idle(S, "g", "c", min_idle_ms=20, ack_dead=False)
    assert [d.id for d in again.dead] == [first.dead[0].id]
    assert again.dead[0].deliveries == 3
    await log.ack(S, "g", again.dead[0].id)
    assert await log.pending_count(S, "g") == 0
    letters = await log.read(log.names.dead)
    assert [e.event.source_id for e in letters] == [first.dead[0].id]  # type: ignore[attr-defined]
    assert log.dead_lettered == 1


@pytest.mark.parametrize("ack_dead", [True, False])
async def test_own_pending_reread_counts_deliveries(
    make_log: LogFactory, ack_dead: bool
) -> None:
    # A consumer that restarts under the same name and dies on the same entry each time
    # ends up dead-lettering it instead of crash-looping.
    log = make_log(max_deliveries=2)
    await log.ensure_group(S, "g")
    await log.append_many([(S, failed(0)), (S, failed(1))])
    got = await log.read_group("g", "w", [S], block_ms=50)  # delivery 1 of both
    await log.ack(S, "g", got[1].id)
    restart = await log.read_own_pending("g", "w", S, ack_dead=ack_dead)  # delivery 2
    assert [e.id for e in restart.entries] == [got[0].id] and restart.dead == []
    assert restart.deliveries == {got[0].id: 2}
    second = await log.read_own_pending("g", "w", S, ack_dead=ack_dead)  # delivery 3
    assert second.entries == [] and [d.id for d in second.dead] == [got[0].id]
    assert second.dead[0].event == failed(0)
    assert await log.pending_count(S, "g") == (0 if ack_dead else 1)
    (letter,) = await log.read(log.names.dead)
    assert isinstance(letter.event, DeadLetter) and letter.event.source_id == got[0].id


async def test_own_pending_without_limit_returns_every_entry(
    make_log: LogFactory,
) -> None:
    # Leases held for a long time (a finalizer's rollout request) survive any number of
    # restarts.
    log = make_log(max_deliveries=1)
    await log.ensure_group(S, "g")
    await log.append(S, failed(0))
    (env,) = await log.read_group("g", "f", [S], block_ms=50)
    for _restart in range(3):
        result = await log.read_own_pending("g", "f", S, limit=False)
        assert [e.id for e in result.entries] == [env.id] and result.dead == []
    assert await log.read(log.names.dead) == []


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"e": b"\xc1\x00garbage"}, "not a msgpack event"),
        ({b"e": msgpack.packb({"type": "Martian", "v": 1})}, "unknown event type"),
        ({b"e": msgpack.packb({"type": "RolloutFailed", "v": 1, "rollout_id": "x"})},
         "reason"),
        ({b"e": msgpack.packb({"type": "RolloutFailed", "v": 9, "rollout_id": "x",
                               "reason": "y"})}, "newer than this engine"),
        ({b"other": b"1"}, "no 'e' field"),
    ],
    ids=["garbage", "unknown-type", "missing-field", "newer-version", "no-field"],
)
async def test_poison_entries_are_dead_lettered_and_reader_carries_on(
    log: EventLog, fields: dict[bytes, bytes], reason: str
) -> None:
    await log.ensure_group(S, "g")
    await log.append(S, failed(1))
    bad_id = await write_raw(log, S, fields)
    await log.append(S, failed(2))
    got = await log.read_group("g", "c", [S], block_ms=50)
    assert [e.event.rollout_id for e in got] == ["r1", "r2"]  # type: ignore[attr-defined]
    assert log.dead_lettered == 1
    (letter,) = await log.read(log.names.dead)
    assert isinstance(letter.event, DeadLetter)
    assert letter.event.source_stream == S and letter.event.source_id == bad_id
    assert letter.event.raw == fields.get(b"e", b"")
    assert reason in letter.event.error
    assert letter.event.group == "g"
    # acked: nothing of the poison entry is left pending
    pending = await log.read_own_pending("g", "c", S, limit=False)
    assert [e.id for e in pending.entries] == [e.id for e in got]


async def test_plain_reads_skip_bad_entries_and_only_the_owner_dead_letters_them_once(
    log: EventLog, make_log: LogFactory
) -> None:
    junk = await write_raw(log, S, {b"e": b"junk"})
    await log.append(S, failed(3))
    # Readers that do not own the stream skip the entry and write nothing, however often.
    for _ in range(3):
        assert len(await log.read(S)) == 1
        assert len(await log.read_all(S)) == 1
        assert len((await log.read_after(S, "0-0", block_ms=0))[0]) == 1
        assert len(await log.tail({S: "0-0"}, block_ms=10)) == 1
    assert log.dead_lettered == 0 and await log.read(log.names.dead) == []
    # The owner dead-letters it once, even when it (or another owner process) reads again.
    other_owner = make_log()
    for reader in (log, log, other_owner):
        assert len(await reader.read_all(S, dead_letter=True)) == 1
    (letter,) = await log.read(log.names.dead)
    assert isinstance(letter.event, DeadLetter) and letter.event.source_id == junk
    assert letter.event.raw == b"junk"
    assert log.dead_lettered + other_owner.dead_lettered == 1


async def test_dead_marks_are_listed_and_forgotten(log: EventLog) -> None:
    junk = await write_raw(log, S, {b"e": b"junk"})
    assert await log.dead_marks() == set()
    await log.read_all(S, dead_letter=True)
    assert await log.dead_marks() == {f"{S}@{junk}"}
    assert await log.forget_dead_marks([f"{S}@{junk}", f"{S}@9-9"]) == 1
    assert await log.dead_marks() == set() and await log.forget_dead_marks([]) == 0
    # A forgotten mark no longer stops a second letter for an entry still in its stream.
    await log.read_all(S, dead_letter=True)
    assert len(await log.read(log.names.dead)) == 2


async def test_trim_keeps_unacked_entries(log: EventLog) -> None:
    await log.ensure_group(S, "g")
    ids = await log.append_many([(S, failed(i)) for i in range(6)])
    got = await log.read_group("g", "c", [S], count=4, block_ms=50)
    await log.ack(S, "g", got[0].id, got[1].id, got[3].id)  # got[2] still pending
    await log.trim_acked(S)
    remaining = [e.id for e in await log.read(S)]
    assert remaining == ids[2:]


async def test_encoded_bytes_are_what_is_stored(log: EventLog) -> None:
    ev = failed(5).model_copy(update={"producer": "test"})
    entry = await log.append(S, failed(5))
    assert await log.read_raw(S) == [(entry, encode(ev))]


async def test_a_handed_back_entry_is_claimable_at_once_and_not_charged(
    make_log: LogFactory,
) -> None:
    log = make_log(max_deliveries=2)
    await log.ensure_group(S, "g")
    await log.append_many([(S, failed(0)), (S, failed(1))])
    got = await log.read_group("g", "a", [S], block_ms=50)  # delivery 1 of both
    # "b" takes the second one over (delivery 2); "a" then hands back both
    await asyncio.sleep(0.03)
    taken = await log.claim_idle(S, "g", "b", min_idle_ms=20, count=1)
    assert [e.id for e in taken.entries] == [got[0].id]
    lost = await log.hand_back(S, "g", "a", [e.id for e in got])
    assert lost == [got[0].id]  # no longer a's to hand back
    # claimable at once by a consumer with a long idle window, still on delivery 1
    again = await log.claim_idle(S, "g", "c", min_idle_ms=60_000)
    assert [e.id for e in again.entries] == [got[1].id]
    assert again.deliveries == {got[1].id: 1} and again.dead == []
    # the entry "b" holds was not touched: still its own, on delivery 2
    assert taken.deliveries == {got[0].id: 2}
    assert await log.keep_alive(S, "g", "b", [got[0].id]) == []
    assert await log.keep_alive(S, "g", "c", [got[1].id]) == []
    held = await log.unread_own_pending("g", "b", S)
    assert held.deliveries == {got[0].id: 2}


async def test_blocking_reads_wake_on_an_append_and_zero_does_not_block(
    make_log: LogFactory,
) -> None:
    reader, writer = make_log(block_ms=5000), make_log()
    await reader.ensure_group(S, "g")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert await reader.read_group("g", "c", [S], block_ms=0) == []
    assert await reader.tail({S: "$"}, block_ms=0) == []
    assert loop.time() - t0 < 2  # neither waited for its 5 s block
    waiting = asyncio.gather(
        reader.read_group("g", "c", [S]), reader.tail({S: "0-0"}),
        reader.read_after(S, "0-0"),
    )
    await asyncio.sleep(0.05)
    entry = await writer.append(S, failed(0))
    grouped, tailed, (after, position) = await asyncio.wait_for(waiting, 4)
    assert [e.id for e in grouped] == [e.id for e in tailed] == [e.id for e in after] == [entry]
    assert position == entry


async def test_a_cross_slot_compare_and_append_is_refused_naming_the_keys(
    log: EventLog,
) -> None:
    names = log.names
    with pytest.raises(LogError, match=r"one cluster slot.*rl:\{rl\}:data.*rl:\{rollout:r1\}"):
        await log.append_if_last(names.data, failed(0), "0-0",
                                 also=[(names.rollout("r1"), failed(1))])
    with pytest.raises(LogError, match="one cluster slot"):
        await log.append_once(names.rollout("r1"), failed(0), names.once("x"))
    assert await log.read_raw(names.data) == []
    assert await log.read_raw(names.rollout("r1")) == []
    # the same step inside the control plane is one atomic step, on a cluster too
    ids = await log.append_if_last(names.pool, failed(2), "0-0",
                                   also=[(names.work("math"), failed(3))])
    assert len(ids) == 2


async def test_group_reads_of_a_missing_group_are_refused(log: EventLog) -> None:
    await log.append(S, failed(0))
    with pytest.raises(LogError):
        await log.read_group("nope", "c", [S], block_ms=0)
    assert await log.group_consumers(S, "nope") == {}
    await log.ensure_group(S, "g")
    await log.read_group("g", "c", [S], block_ms=0)
    assert set(await log.group_consumers(S, "g")) == {"c"}


# ------------------------------------------------- raw reads, listing, snapshots, markers, trims


async def test_raw_reads_return_stored_bytes_and_dead_letter_nothing(log: EventLog) -> None:
    ids = [await log.append(S, failed(i)) for i in range(5)]
    stored = await log.read_raw(S, page=2)
    assert [i for i, _ in stored] == ids
    assert stored[0][1] == encode(failed(0).model_copy(update={"producer": "test"}))
    assert [i for i, _ in await log.read_raw(S, after=ids[2], page=2)] == ids[3:]
    assert await log.read_raw(f"{S}:missing") == []
    assert [i for i, _ in await log.read_raw(S, page=2, limit=3)] == ids[:3]
    assert [i for i, _ in await log.read_raw(S, after=ids[0], limit=10)] == ids[1:]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        await log.read_raw(S, limit=0)
    assert log.dead_lettered == 0


async def test_raw_tail_follows_several_streams_without_dead_lettering(
    log: EventLog, make_log: LogFactory
) -> None:
    a, b = f"{S}:a", f"{S}:b"
    first = await log.append(a, failed(0))
    junk = await write_raw(make_log(), b, {b"e": b"junk"})
    got = await log.tail_raw({a: "0-0", b: "0-0"}, block_ms=50)
    assert sorted((s, i) for s, i, _ in got) == [(a, first), (b, junk)]
    assert dict((s, raw) for s, _, raw in got)[b] == b"junk"
    assert log.dead_lettered == 0
    # past every position and nothing new: an empty list after the block
    assert await log.tail_raw({a: first, b: junk}, block_ms=20) == []


async def test_streams_are_listed_by_pattern(log: EventLog) -> None:
    for name in ("rl:work:{a}", "rl:work:{b}", "rl:other"):
        await log.append(name, failed(0))
    await log.write_snapshot("notastream", b"x")
    assert await log.list_streams("rl:work:*") == ["rl:work:{a}", "rl:work:{b}"]
    assert await log.list_streams(f"{log.names.plane}:snapshot:*") == []


async def test_snapshots_round_trip_by_name(log: EventLog) -> None:
    assert await log.read_snapshot("pool") is None
    await log.write_snapshot("pool", b"\x00state")
    assert await log.read_snapshot("pool") == b"\x00state"


async def test_a_closed_log_can_be_closed_again(log: EventLog) -> None:
    await log.append(S, failed(0))
    await log.aclose()
    await log.aclose()


async def test_append_once_lands_once_per_marker(log: EventLog) -> None:
    marker = log.names.once("RolloutReady.r1")
    first = await log.append_once(log.names.control, failed(1), marker)
    assert first is not None
    assert await log.append_once(log.names.control, failed(1), marker) is None
    assert await log.append_once(log.names.control, failed(2),
                                 log.names.once("RolloutReady.r2")) is not None
    assert [e.event.rollout_id for e in await log.read(log.names.control)] == ["r1", "r2"]  # type: ignore[attr-defined]


async def test_trim_before_drops_only_older_entries(log: EventLog) -> None:
    ids = await log.append_many([(S, failed(i)) for i in range(5)])
    assert await log.trim_before(S, ids[3]) == 3
    assert [e.id for e in await log.read(S)] == ids[3:]


async def test_first_id_is_where_a_trim_left_the_stream(log: EventLog) -> None:
    assert await log.first_id(S) == "0-0"
    ids = await log.append_many([(S, failed(i)) for i in range(3)])
    assert await log.first_id(S) == ids[0]
    await log.trim_before(S, ids[2])
    assert await log.first_id(S) == ids[2]


# ------------------------------------------------- the Redis adapter's own


@pytest.fixture
def redis_log(redis_factory: ClientFactory) -> RedisEventLog:
    return RedisEventLog(redis_factory(), producer="test", block_ms=200)


async def test_a_cancellation_a_redis_call_swallows_still_takes_effect(
    redis_log: RedisEventLog,
) -> None:
    # On Python 3.11 asyncio.wait_for (which redis-py sends commands under) returns
    # normally when a cancellation lands just as the send completes. A reader looping
    # over the log must still stop at its next call instead of running on forever.
    await redis_log.append(S, failed(0))
    real = redis_log._r.xread
    swallowed: list[bool] = []

    async def xread_swallowing_cancel(*args: object, **kwargs: object) -> object:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            swallowed.append(True)  # what wait_for does with a send that completed
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    redis_log._r.xread = xread_swallowing_cancel  # type: ignore[method-assign]

    async def follow() -> None:
        position = "0-0"
        while True:
            _envs, position = await redis_log.read_after(S, position, block_ms=20)

    task = asyncio.create_task(follow())
    try:
        await asyncio.sleep(0.02)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        assert swallowed == [True]
        assert done and task.cancelled()
    finally:  # without the fix the reader runs on: stop it for real
        redis_log._r.xread = real  # type: ignore[method-assign]
        task.cancel()
        await asyncio.wait([task], timeout=5)


async def test_an_unreachable_store_raises_log_unavailable() -> None:
    # A port that nothing listens on: the redis error is translated at the adapter.
    log = open_log(RedisSettings(url="redis://127.0.0.1:1/0", block_ms=50, connect_timeout_s=1))
    with pytest.raises(LogUnavailable):
        await log.append(S, failed(0))
    with pytest.raises(LogUnavailable):
        await log.read_raw(S)
    await log.aclose()
