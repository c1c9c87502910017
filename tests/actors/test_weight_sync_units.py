"""The pure parts of the weight sync: the policy fold, the turn gate, the weights URI, and the
events' old schema versions."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from engine.actors.weight_sync import weights_path
from engine.backends.gate import TurnGate
from engine.client import RefillLoop, RolloutClient
from engine.errors import ConfigError
from engine.events import (
    Envelope,
    Event,
    EventLog,
    PolicyVersionActivated,
    PolicyVersionPublished,
    QuiesceCompleted,
    QuiesceRequested,
    RolloutReady,
    RolloutRequested,
    WeightSyncFailed,
    WorkerParked,
)
from engine.events.codec import decode
from engine.projections.base import fold, start
from engine.projections.control import ControlProjection, ControlState
from tests.rig import events_of


def folded(*events: Event) -> ControlState:
    envs = [Envelope("rl:control", f"{i + 1}-0", ev) for i, ev in enumerate(events)]
    projection = ControlProjection()
    return fold(projection, start(projection), envs).state


def test_a_sync_stops_generation_until_its_version_is_active() -> None:
    state = folded()
    assert state.may_generate(0) and state.current_version(3) == 3
    state = folded(PolicyVersionPublished(version=1, weights_uri="/w1"))
    # The published version waits for its sync; the initial weights do not.
    assert state.needs_sync(1) and not state.needs_sync(0) and state.current_version() == 1
    state = folded(
        PolicyVersionPublished(version=1, weights_uri="/w1"),
        QuiesceRequested(version=1),
        WorkerParked(version=1, worker="w1"),
        WorkerParked(version=7, worker="w2"),  # another sync's: not counted
    )
    assert state.generation_stopped and not state.may_generate(0)
    assert state.parked == {"w1"} and state.quiesce_id == "2-0"
    assert "version 1 in progress" in state.why_stopped()
    state = folded(
        PolicyVersionPublished(version=1, weights_uri="/w1"),
        QuiesceRequested(version=1),
        QuiesceCompleted(version=1, parked=["w1"]),
        PolicyVersionActivated(version=1, servers=["http://a:1"]),
    )
    assert state.may_generate(1) and state.active_version == 1 and state.quiesce is None


def test_a_failed_sync_poisons_until_a_later_one_succeeds() -> None:
    failed = WeightSyncFailed(version=2, error="http://b:2: refused", servers_failed=["http://b:2"])
    events: list[Event] = [
        PolicyVersionPublished(version=2, weights_uri="/w2"),
        QuiesceRequested(version=2),
        failed,
    ]
    state = folded(*events)
    assert state.poisoned and state.generation_stopped and state.quiesce is None
    assert state.failure == failed and "refused" in state.why_stopped()
    events += [PolicyVersionPublished(version=3, weights_uri="/w3"), QuiesceRequested(version=3)]
    assert folded(*events).poisoned  # still, while the next sync runs
    events.append(PolicyVersionActivated(version=3, servers=["http://a:1", "http://b:2"]))
    state = folded(*events)
    assert not state.poisoned and state.may_generate(3) and state.may_generate(2)


async def test_the_gate_lets_calls_in_flight_finish_and_holds_new_ones() -> None:
    gate = TurnGate()
    order: list[str] = []
    release = asyncio.Event()

    async def call(name: str, hold: bool) -> None:
        async with gate.turn():
            order.append(f"{name}-start")
            if hold:
                await release.wait()
            order.append(f"{name}-end")

    running = asyncio.create_task(call("a", hold=True))
    await asyncio.sleep(0)
    assert gate.in_flight == 1
    gate.close("sync")
    waiting = asyncio.create_task(call("b", hold=False))
    drained = asyncio.create_task(gate.drained())
    await asyncio.sleep(0.01)
    assert order == ["a-start"] and not drained.done()
    release.set()
    await drained  # the call in flight finished; the new one has not started
    assert order == ["a-start", "a-end"] and gate.in_flight == 0
    gate.open()
    await asyncio.gather(running, waiting)
    assert order == ["a-start", "a-end", "b-start", "b-end"]


async def test_a_cancelled_call_leaves_the_gate_drained() -> None:
    gate = TurnGate()
    task = asyncio.create_task(_hold(gate))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.in_flight == 0
    await asyncio.wait_for(gate.drained(), 1)


async def _hold(gate: TurnGate) -> None:
    async with gate.turn():
        await asyncio.Event().wait()


def test_weights_uri_is_a_local_directory() -> None:
    assert weights_path("/data/w/v3") == "/data/w/v3"
    assert weights_path("file:///data/w/v%203") == "/data/w/v 3"
    for bad, why in (("", "empty"), ("s3://bucket/w", "only local"), ("file://host/w", "local")):
        with pytest.raises(ConfigError, match=why):
            weights_path(bad)


def test_quiesce_events_of_schema_v1_still_decode() -> None:
    for name, cls in [("QuiesceRequested", QuiesceRequested),
                      ("QuiesceCompleted", QuiesceCompleted)]:
        raw = msgpack.packb({"type": name, "reason": "weight sync", "v": 1})
        ev = decode(raw)
        assert isinstance(ev, cls) and ev.version is None and ev.reason == "weight sync"
    done = decode(msgpack.packb({"type": "QuiesceCompleted", "reason": "", "v": 1}))
    assert isinstance(done, QuiesceCompleted) and done.parked == [] and done.unparked == []


@pytest.mark.parametrize("ahead", [0, 1])
async def test_the_refill_loop_requests_ahead_and_carries_the_published_version(
    log: EventLog, ahead: int
) -> None:
    """A stand-in finalizer answers every request at once; what matters is which requests
    exist when the trainer gets each rollout, and the version each one carries."""
    client = RolloutClient(log)

    async def finalize() -> None:
        position = "0-0"
        while True:
            envs, position = await log.read_after(log.names.control, position, block_ms=50)
            for env in envs:
                if isinstance(env.event, RolloutRequested):
                    rid = env.event.rollout_id
                    ready = RolloutReady(rollout_id=rid, sample_ids=[])
                    stream = log.names.rollout(rid)
                    await log.append_many([(stream, env.event), (stream, ready),
                                           (log.names.control, ready)])

    def requests() -> list[tuple[int, int]]:
        return [(r.iteration, r.policy_version) for r in requested]

    answering = asyncio.create_task(finalize())
    seen: list[list[tuple[int, int]]] = []
    try:
        loop = RefillLoop(client, ahead=ahead, n_prompts=2)
        async for it in loop.iterations(3):
            requested = await events_of(log, log.names.control, RolloutRequested)
            seen.append(requests())
            # one publication per iteration; with ahead=1 it was requested one step earlier
            assert it.requested_version == max(0, it.iteration - ahead)
            await loop.publish(it.iteration + 1, f"/weights/v{it.iteration + 1}")
    finally:
        answering.cancel()
        await asyncio.gather(answering, return_exceptions=True)
    if ahead:  # rollout N+1 was requested (at the version before training on N) before N
        assert seen == [[(0, 0), (1, 0)], [(0, 0), (1, 0), (2, 1)],
                        [(0, 0), (1, 0), (2, 1)]]
    else:
        assert seen == [[(0, 0)], [(0, 0), (1, 1)], [(0, 0), (1, 1), (2, 2)]]
    published = await events_of(log, log.names.control, PolicyVersionPublished)
    assert [(p.version, p.weights_uri) for p in published] == [
        (1, "/weights/v1"), (2, "/weights/v2"), (3, "/weights/v3")]
