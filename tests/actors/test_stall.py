"""A stalled rollout says what it waits for: ``decide_stall`` from folded events (given /
when / then), and a finalizer that appends it for a rollout nobody works on, as
``rollout status`` shows it."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime

from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.actors.stall import ServerWord, decide_stall, servers_said
from engine.events import (
    Envelope,
    Event,
    EventLog,
    PolicyVersionActivated,
    PolicyVersionPublished,
    QuiesceRequested,
    RolloutRequested,
    RolloutStalled,
    SampleAborted,
    SampleStarted,
    ServerDown,
    ServerStale,
    ServerUp,
    TokenAcquired,
    WeightSyncFailed,
    WorkerParked,
)
from engine.events.catalog import AbortClass
from engine.events.catalog.servers import ServerRegistered
from engine.ops.inspection import last_stall, status_lines
from engine.projections.control import ControlProjection, ControlState
from engine.projections.placement import PoolProjection, PoolState
from engine.projections.rollout import RolloutState
from tests.actors.play import plan_events
from tests.rig import envelopes, rollout_state, start_rollout

REQUEST = RolloutRequested(rollout_id="r", n_prompts=8, policy_version=2)
WINDOW = 60.0


def planned(request: RolloutRequested = REQUEST) -> tuple[list[Event], list[TokenAcquired]]:
    """Two batches of four samples (``r:b0``: r:s0-3, ``r:b4``: r:s4-7), and their
    acquisitions."""
    events, admissions = plan_events(request, batch_size=4)
    return events, [acquired for acquired, _ in admissions]


def pool(*events: Event) -> PoolState:
    projection = PoolProjection()
    state = projection.initial()
    for env in envelopes(list(events)):
        state = projection.evolve(state, env)
    return state


def policy(*events: Event) -> ControlState:
    projection = ControlProjection()
    state = projection.initial()
    for env in envelopes(list(events)):
        state = projection.evolve(state, env)
    return state


def started(i: int, worker: str) -> SampleStarted:
    return SampleStarted(rollout_id="r", sample_id=f"r:s{i}", attempt=1, batch_id="r:b0",
                         worker=worker)


def aborted(i: int) -> SampleAborted:
    return SampleAborted(rollout_id="r", sample_id=f"r:s{i}", attempt=1,
                         abort_class=AbortClass.INFRA_CONN)


def servers(*said: tuple[str, Event]) -> dict[str, ServerWord]:
    """``rl:control``'s server events folded, each at its wall-clock time (``HH:MM:SS`` on
    2026-12-02, UTC)."""
    out: dict[str, ServerWord] = {}
    for at, ev in said:
        ms = int(datetime.strptime(f"2026-12-02 {at}", "%Y-%m-%d %H:%M:%S")
                 .replace(tzinfo=UTC).timestamp() * 1000)  # fmt: skip
        out = dict(servers_said(out, Envelope("rl:control", f"{ms}-0", ev)))
    return out


def stall(
    state: RolloutState,
    pool_state: PoolState | None = None,
    policy_state: ControlState | None = None,
    consumers: dict[str, dict[str, int]] | None = None,
    *,
    idle_s: float = 90.0,
    since_report_s: float | None = None,
    server_words: dict[str, ServerWord] | None = None,
) -> RolloutStalled | None:
    return decide_stall(
        state, pool_state or pool(), policy_state or policy(), consumers or {},
        idle_s=idle_s, since_report_s=since_report_s, window_s=WINDOW, servers=server_words,
    )


def test_nothing_is_said_within_the_window_nor_twice_in_one() -> None:
    events, _ = planned()
    state = rollout_state(events)
    assert stall(state, idle_s=59.0) is None
    assert stall(state, since_report_s=30.0) is None
    assert stall(state, since_report_s=60.0) is not None


def test_a_request_nobody_planned_waits_for_the_plan() -> None:
    stalled = stall(rollout_state([REQUEST]))
    assert stalled is not None and stalled.rollout_id == "r"
    assert stalled.waiting_for == [
        "the plan: no RolloutPlanned yet (no scheduler has planned the request)"
    ]


def test_batches_the_pool_has_not_placed_wait_for_admission_and_name_the_pool() -> None:
    # Given r:b0 admitted and running on w1, r:b4 not placed,
    events, [first, _second] = planned()
    state = rollout_state([*events, started(0, "w1"), started(1, "w1")])
    # when the rollout has not moved for the window,
    stalled = stall(state, pool(first))
    # then it waits for r:b4's admission (the pool holds r:b0's tokens) and w1's samples.
    assert stalled is not None
    assert (stalled.not_admitted, stalled.not_started, stalled.running) == (1, 0, {"w1": 2})
    assert stalled.waiting_for == [
        "admission of 1 batches: the placement pool (4 tokens held by 1 batches)",
        "2 samples running on w1 (2)",
    ]


def test_admission_names_an_open_or_failed_weight_sync_and_an_unreachable_bound() -> None:
    events, _ = planned()
    state = rollout_state(events)
    sync = policy(PolicyVersionPublished(version=3),
                  QuiesceRequested(version=3), WorkerParked(version=3, worker="w1"))
    stalled = stall(state, policy_state=sync)
    assert stalled is not None
    assert stalled.waiting_for[0] == (
        "admission of 2 batches: the weight sync of version 3 is open (1 workers parked)"
    )
    poisoned = policy(WeightSyncFailed(version=3, error="load failed"))
    stalled = stall(state, policy_state=poisoned)
    assert stalled is not None and "poisoned by the failed weight sync of version 3" in (
        stalled.waiting_for[0]
    )
    ahead = REQUEST.model_copy(update={"policy_version": 9, "max_staleness": 1})
    events, _ = planned(ahead)
    stalled = stall(rollout_state(events), policy_state=policy(
        PolicyVersionPublished(version=2)))
    assert stalled is not None and "staleness bound needs weights of version 8" in (
        stalled.waiting_for[0]
    )
    paced = REQUEST.model_copy(update={"max_staleness": 0, "staleness_policy": "pace"})
    before = RolloutRequested(rollout_id="q", n_prompts=1, max_staleness=0)
    events, _ = planned(paced)
    stalled = stall(rollout_state(events), policy_state=policy(before, paced))
    assert stalled is not None and "staleness_policy 'pace': 1 earlier bounded rollouts" in (
        stalled.waiting_for[0]
    )


def test_admitted_batches_nobody_started_name_the_consumers_of_their_work_stream() -> None:
    events, acquired = planned()
    state = rollout_state([*events, aborted(4), aborted(5), aborted(6), aborted(7)])
    # Given r:b4 is finished and r:b0 is admitted but not started,
    stalled = stall(state, pool(*acquired))
    assert stalled is not None and stalled.not_started == 1
    assert stalled.waiting_for == [
        "workers for 1 admitted batches: rl:work:scripted has no consumer (no worker serves "
        "it)"
    ]
    # with consumers: who they are and how long each has been idle.
    stalled = stall(state, pool(*acquired), consumers={"scripted": {"w2": 4200, "w1": 300}})
    assert stalled is not None and stalled.consumers == {"w1": 300, "w2": 4200}
    assert stalled.waiting_for == [
        "workers for 1 admitted batches: rl:work:scripted consumed by w1 idle 0.3 s, w2 idle "
        "4.2 s"
    ]


A, B = "http://gpu0:30000", "http://gpu1:30000"


def test_an_eval_pinned_to_a_version_no_server_serves_names_it_and_the_fix() -> None:
    # Given an eval pinned to version 0 running on w1, the policy at version 1 and an eval
    # server registered at version 3 only,
    pinned = RolloutRequested(rollout_id="r", n_prompts=8, kind="eval", pinned_version=0)
    events, [first, _] = planned(pinned)
    state = rollout_state([*events, started(0, "w1")])
    at_3 = ServerRegistered(endpoint=A, role="eval", backend="tinylm", supervisor="s",
                            weight_version=3)  # fmt: skip
    control = policy(PolicyVersionActivated(version=1, servers=[B]), at_3)
    # when the rollout has not moved for the window,
    stalled = stall(state, pool(first), policy_state=control)
    # then it names the version it waits for, what is registered, and the fix;
    assert stalled is not None
    assert stalled.waiting_for[1] == (
        "a model server serving weight version 0, the version the rollout is pinned to "
        "(active policy version 1; eval servers registered: http://gpu0:30000 (version 3)): "
        "start one with rollout serve --role eval --model PATH --weight-version 0"
    )
    # and says nothing of it once an eval server at version 0 is registered.
    at_0 = at_3.model_copy(update={"endpoint": B, "weight_version": 0})
    stalled = stall(state, pool(first), policy_state=policy(at_3, at_0))
    assert stalled is not None and not any("pinned" in w for w in stalled.waiting_for)


def test_samples_waiting_on_servers_down_or_stale_name_them_since_when_and_why() -> None:
    # Given samples running on w1, server A down (said by w1, then w2), B stale after a
    # restart from older weights, and a third server that went down and came back,
    events, [first, _] = planned()
    state = rollout_state([*events, started(0, "w1")])
    words = servers(
        ("03:40:00", ServerUp(endpoint="http://gpu2:30000", worker="w1", weight_version=1)),
        ("03:41:07", ServerDown(endpoint=A, worker="w1",
                                reason="POST http://gpu0:30000/generate: could not connect")),
        ("03:41:09", ServerDown(endpoint=A, worker="w2", reason="health probe failed")),
        ("03:42:00", ServerStale(endpoint=B, worker="w2", weight_version=None, active=1)),
        ("03:42:30", ServerDown(endpoint="http://gpu2:30000", worker="w1", reason="reset")),
        ("03:42:31", ServerUp(endpoint="http://gpu2:30000", worker="w1", weight_version=1)),
    )
    # when the rollout has not moved for the window,
    stalled = stall(state, pool(first), server_words=words)
    # then the waits name each server out of service: since its first word, and why.
    assert stalled is not None
    assert stalled.waiting_for == [
        "admission of 1 batches: the placement pool (4 tokens held by 1 batches)",
        "policy servers not serving: http://gpu0:30000 down since 2026-12-02 03:41:07 UTC "
        "(worker w2): health probe failed; http://gpu1:30000 stale since 2026-12-02 03:42:00 "
        'UTC (worker w2): it reports weight version unknown ("default"), the active one is 1',
        "1 samples running on w1 (1)",
    ]


def test_with_every_server_down_admission_waits_for_them_and_a_finished_rollout_does_not(
) -> None:
    # Given both servers down as rl:control has it,
    events, _ = planned()
    down = [ServerDown(endpoint=A, worker="w1", reason="could not connect"),
            ServerStale(endpoint=B, worker="w1", weight_version=0, active=2)]
    # when the rollout waits for admission,
    stalled = stall(rollout_state(events), policy_state=policy(*down),
                    server_words=servers(*(("03:00:00", ev) for ev in down)))
    # then admission waits for a server, and the waits say which are out and why.
    assert stalled is not None
    assert stalled.waiting_for[0] == "admission of 2 batches: every policy server is down or stale"
    assert stalled.waiting_for[1].startswith("policy servers not serving: http://gpu0:30000 down")
    assert "it reports weight version 0, the active one is 2" in stalled.waiting_for[1]
    # Given every sample terminal, the servers are nobody's wait.
    finished = rollout_state([*events, *(aborted(i) for i in range(8))])
    stalled = stall(finished, server_words=servers(("03:00:00", down[0])))
    assert stalled is not None
    assert stalled.waiting_for == ["every sample is terminal: the finalizer's decision"]


def test_rollout_status_shows_the_servers_a_stalled_rollout_waits_on() -> None:
    events, _ = planned()
    state = rollout_state(events)
    down = ServerDown(endpoint=A, worker="w1", reason="stalled: no event for 20 s")
    stalled = stall(state, server_words=servers(("03:41:07", down)))
    assert stalled is not None
    lines = status_lines(state, last_stall(envelopes([*events, stalled])))
    assert lines[4] == ("  - policy servers not serving: http://gpu0:30000 down since "
                        "2026-12-02 03:41:07 UTC (worker w1): stalled: no event for 20 s")


def test_a_decided_rollout_is_never_stalled() -> None:
    events, _ = planned()
    from engine.events import RolloutFailed

    assert stall(rollout_state([*events, RolloutFailed(rollout_id="r", reason="x")])) is None


def test_rollout_status_shows_the_last_report_until_the_rollout_moves() -> None:
    events, _ = planned()
    state = rollout_state(events)
    stalled = stall(state)
    assert stalled is not None
    envs = envelopes([*events, stalled])
    lines = status_lines(state, last_stall(envs))
    assert lines[2] == "stalled: no progress for 90 s; waiting for:"
    assert lines[3].startswith("  - admission of 2 batches")
    moved = [*envs, Envelope("s", "99-0", started(0, "w1"))]
    assert last_stall(moved) is None
    assert "stalled" not in "\n".join(status_lines(state, last_stall(moved)))


async def test_the_finalizer_reports_a_rollout_no_worker_takes(log: EventLog) -> None:
    # Given a planned, admitted rollout and no evaluator worker,
    finalizer = Finalizer(log, FinalizerConfig(consumer="f1", block_ms=50, heartbeat_ms=50,
                                               claim_idle_ms=400, stall_window_s=0.3))
    stop = asyncio.Event()
    task = asyncio.create_task(finalizer.run(stop))
    try:
        await start_rollout(log, "rs", n_prompts=2)
        stream = log.names.rollout("rs")

        async def reported() -> list[RolloutStalled]:
            while True:
                found = [e.event for e in await log.read_all(stream)
                         if isinstance(e.event, RolloutStalled)]
                if found:
                    return found
                await asyncio.sleep(0.05)

        # when it does not move for the window, then the finalizer says so, once a window.
        [first, *_] = await asyncio.wait_for(reported(), 10)
        assert first.rollout_id == "rs" and first.idle_s >= 0.3
        assert first.waiting_for == [
            "workers for 1 admitted batches: rl:work:scripted has no consumer (no worker "
            "serves it)"
        ]
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


async def test_the_finalizer_names_a_down_server_the_rollout_waits_on(log: EventLog) -> None:
    # Given a worker that said its server is down, and a rollout nobody works on,
    finalizer = Finalizer(log, FinalizerConfig(consumer="f1", block_ms=50, heartbeat_ms=50,
                                               claim_idle_ms=400, stall_window_s=0.3))
    await log.append(log.names.control, ServerDown(endpoint=A, worker="w1",
                                                   reason="could not connect"))  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(finalizer.run(stop))
    try:
        await start_rollout(log, "rd", n_prompts=2)
        stream = log.names.rollout("rd")

        async def reported() -> RolloutStalled:
            while True:
                for e in await log.read_all(stream):
                    if isinstance(e.event, RolloutStalled):
                        return e.event
                await asyncio.sleep(0.05)

        # when it stalls, then the report names the server, its worker and its error.
        first = await asyncio.wait_for(reported(), 10)
        (line,) = [w for w in first.waiting_for if w.startswith("policy servers")]
        assert line.startswith("policy servers not serving: http://gpu0:30000 down since ")
        assert line.endswith(" UTC (worker w1): could not connect")
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)
