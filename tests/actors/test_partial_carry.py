"""A carried tail (issue 12, point 6, ``tail="carry"``): the decisions, pure.

Rollout A of request stream ``run`` is over-provisioned and becomes ready with its first
whole groups; its tail keeps running, recorded as ``TailCarried`` on ``rl:data``. The next
request of the stream, B, takes the carried groups over: they count toward its prompts (the
data cursor fetches only the rest), they open B's stream as ``TaskFetched`` marked with the
rollout they run in, and their lifecycle events, copied into B's stream, decide B -- so B's
stream alone replays it byte for byte. A later request finds nothing left to take over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from engine.actors.finalizer import carried_sources, decide_ready, tail_carried
from engine.actors.planning import Planner
from engine.actors.scheduler import Scheduler, SchedulerConfig
from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.client import RolloutClient
from engine.config.rollout import load_rollout_config
from engine.data_source import DataCursor
from engine.domain import Task, TerminationReason
from engine.events import (
    DataCursorAdvanced,
    Envelope,
    Event,
    EventLog,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    TokenIds,
)
from engine.events.catalog import RolloutReady, TailCarried
from engine.events.codec import decode, encode
from engine.events.redis_log import RedisSettings
from engine.events.redis_log import connect as redis_connect
from engine.ops.replay import archive_rollout, decode_entries, read_archive, replay_state
from engine.projections.base import fold, start
from engine.projections.data_cursor import DataCursorProjection, DataState
from engine.projections.readback import Rollout, in_memory
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.projections.summary import render_artifacts
from tests.actors.test_staleness import EVALUATOR, Rig, binding
from tests.redis_server import RedisServer
from tests.scheduler.helpers import load_specs, write_config


def _planner(tmp_path: Path) -> Planner:
    config = write_config(tmp_path, {"gsm": ("math", 20)}, {"aime": ("math", 2)})
    return Planner(load_rollout_config(config), load_specs())


def _fold(events: list[Event]) -> Rollout:
    """The rollout fold over ``events`` (through the wire format), its entries at hand."""
    envs = [Envelope("s", f"{i + 1}-0", decode(encode(ev))) for i, ev in enumerate(events)]
    projection = RolloutProjection()
    return in_memory(fold(projection, start(projection), envs).state, envs)


def _decide(events: list[Event]) -> RolloutState:
    """The rollout fold over ``events`` (what the finalizer decides from)."""
    return _fold(events).state


def _tail_carried(events: list[Event], ready: RolloutReady) -> TailCarried | None:
    """The ``TailCarried`` the finalizer hands over, the tail's tasks read from ``events``."""
    rollout = _fold(events)
    tasks = {sid: rollout.task(rollout.state.samples[sid]) for sid in ready.tail_sample_ids}
    return tail_carried(rollout.state, ready, tasks)


def _data(*events: Event) -> DataState:
    projection = DataCursorProjection()
    state = projection.initial()
    for i, ev in enumerate(events):
        state = projection.evolve(state, Envelope("rl:data", f"{i + 1}-0", ev))
    return state


def _done(rollout_id: str, sample_id: str) -> SampleCompleted:
    return SampleCompleted(
        rollout_id=rollout_id, sample_id=sample_id, attempt=1,
        prompt_ids=TokenIds.from_values([1]), response_ids=TokenIds.from_values([2, 3]),
        logprobs=LogProbs.from_values([-1.0, -1.0]), loss_mask=Mask.from_values([1, 1]),
        reward=1.0, termination_reason="finish", token_versions=TokenIds.from_values([0, 0]),
    )


def test_the_next_request_of_the_stream_takes_the_carried_groups_over(tmp_path: Path) -> None:
    planner = _planner(tmp_path)
    req_a = RolloutRequested(rollout_id="A", n_prompts=2, n_samples_per_prompt=2, seed=1,
                             overprovision=2.0, tail="carry", request_stream="run")
    plan_a = planner.plan(req_a, DataState())
    assert len(plan_a.sample_ids) == 8  # 4 groups of 2
    # groups 3 and 0 become whole first; group 1 is half done, group 2 not started
    a_events: list[Event] = plan_a.rollout_events()
    a_events += [_done("A", plan_a.sample_ids[i]) for i in (6, 7, 0, 2, 1)]
    state_a = _decide(a_events)
    ready_a = decide_ready(state_a)
    assert ready_a is not None and ready_a.tail_carried
    assert ready_a.tail_sample_ids == [plan_a.sample_ids[i] for i in (2, 3, 4, 5)]
    carried = _tail_carried(a_events, ready_a)
    assert carried is not None and carried.request_stream == "run"
    assert [t.sample_id for t in carried.tasks] == ready_a.tail_sample_ids

    # B (same stream, 3 prompts) takes A's two tail groups and fetches one new prompt
    data = _data(plan_a.cursor, carried)
    assert [t.rollout_id for t in data.carried_for("run")] == ["A"]
    assert data.carried_for("other") == []
    req_b = RolloutRequested(rollout_id="B", n_prompts=3, n_samples_per_prompt=2, seed=1,
                             request_stream="run")
    plan_b = planner.plan(req_b, data)
    assert plan_b.cursor.carried == ["A"]
    before = DataCursor.model_validate(plan_b.cursor.previous)
    after = DataCursor.model_validate(plan_b.cursor.cursor)
    assert (after.offset - before.offset) % 20 == 1  # one new prompt, not three
    tasks = plan_b.tasks()
    own, taken = tasks[:2], tasks[2:]
    assert all(t.carried_from is None and t.sample_id.startswith("B:") for t in own)
    assert [t.sample_id for t in taken] == ready_a.tail_sample_ids
    assert all(t.carried_from == "A" and t.rollout_id == "B" for t in taken)
    assert [t.index for t in tasks] == list(range(6))
    assert [t.group_index for t in tasks] == [0, 0, 1, 1, 2, 2]
    assert sum(len(b.sample_ids) for b in plan_b.batches) == 2  # A's workers run the rest
    assert plan_b.planned.n_samples == 6
    # an interrupted plan is completed to the same events
    again = planner.replan(req_b, plan_b.cursor, data)
    assert again.rollout_events() == plan_b.rollout_events()
    # taken over once: the next request of the stream finds nothing to take
    data_after = _data(plan_a.cursor, carried, plan_b.cursor)
    assert data_after.carried_for("run") == []

    # B is decided by its own stream: the copies of the carried samples' events in it
    b_events: list[Event] = plan_b.rollout_events()
    b_state = _decide(b_events)
    assert carried_sources(b_state) == {"A": set(ready_a.tail_sample_ids)}
    b_events += [_done("B", t.sample_id) for t in own]
    b_events += [_done("A", t.sample_id) for t in taken]  # relayed from A's stream
    b_state = _decide(b_events)
    ready_b = decide_ready(b_state)
    assert ready_b is not None
    assert ready_b.sample_ids == [t.sample_id for t in tasks]
    live = _fold([*b_events, ready_b])
    replayed = replay_state(
        Envelope("s", f"{i + 1}-0", decode(encode(ev)))
        for i, ev in enumerate([*b_events, ready_b])
    )
    assert render_artifacts(replayed) == render_artifacts(live)


# ---------------------------------------------------------------- end to end


@dataclass
class GatedTailAgent(BaseAgent):
    """Answers at once, except the samples of ``gated`` (rollout id, group index), which
    wait for ``gate``."""

    gated: tuple[str, int]
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if (task.rollout_id, task.group_index) == self.gated:
            await self.gate.wait()
        return AgentResult(
            prompt_token_ids=[1, 2], response_token_ids=[5, 6], response_logprobs=[-0.1, -0.2],
            loss_mask=[1, 1], response_versions=[0, 0],
            turns=(TurnRecord(index=0, prompt_tokens=2, response_tokens=2, weight_version=0),),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return float(task.index % 2)


async def _wait_planned(log: EventLog, rollout_id: str) -> None:
    position = "0-0"
    while True:
        envs, position = await log.read_after(log.names.rollout(rollout_id), position,
                                              block_ms=200)
        if any(isinstance(e.event, RolloutPlanned) for e in envs):
            return


async def test_a_carried_tail_keeps_running_and_completes_the_next_rollout(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    agent = GatedTailAgent(gated=("A", 1))
    rig = Rig(redis_server.url, None, tmp_path / "out")
    rig.start(agent)
    profile = binding(agent)[EVALUATOR].profile
    config = write_config(tmp_path, {"ds": (EVALUATOR, 20)}, {"ev": (EVALUATOR, 2)})
    scheduler = Scheduler(
        rig.log(),
        planner=Planner(load_rollout_config(config), {EVALUATOR: profile}),
        layout=None,
        config=SchedulerConfig(scheduler_id="s0", block_ms=200, heartbeat_ms=1000,
                               claim_idle_ms=5000),
    )
    await scheduler.start()
    rig.tasks.append(asyncio.create_task(scheduler.run(rig.stop)))
    client = RolloutClient(rig.log())
    try:
        a = await client.request(iteration=1, n_prompts=1, n_samples_per_prompt=2, seed=5,
                                 rollout_id="A", overprovision=2.0, tail="carry",
                                 request_stream="run")
        ready_a = await client.wait_ready(a, timeout=60)
        assert ready_a.sample_ids == ["A:s0", "A:s1"] and ready_a.tail_carried
        assert ready_a.tail_sample_ids == ["A:s2", "A:s3"]
        b = await client.request(iteration=2, n_prompts=2, n_samples_per_prompt=2, seed=5,
                                 rollout_id="B", request_stream="run")
        await _wait_planned(client.log, b)
        agent.gate.set()  # A's tail, still running in A's batch, now finishes
        ready_b = await client.wait_ready(b, timeout=60)
        assert ready_b.sample_ids == ["B:s0", "B:s1", "A:s2", "A:s3"]
        samples = await client.load(b)
        assert [s.sample_id for s in samples] == ready_b.sample_ids
        log = client.log
        # the tail was never aborted, its groups counted toward B: one new prompt fetched
        a_events = [e.event for e in await log.read_all(log.names.rollout("A"))]
        assert not any(isinstance(e, SampleAborted) for e in a_events)
        data = [e.event for e in await log.read_all(log.names.data)]
        assert [type(e).__name__ for e in data] == [
            "DataCursorAdvanced", "TailCarried", "DataCursorAdvanced"
        ]
        assert isinstance(data[2], DataCursorAdvanced) and data[2].carried == ["A"]
        before = DataCursor.model_validate(data[2].previous)
        after = DataCursor.model_validate(data[2].cursor)
        assert (after.offset - before.offset) % 20 == 1
        # B's stream holds the carried samples' events, copied from A's: it replays alone
        b_events = [e.event for e in await log.read_all(log.names.rollout("B"))]
        copied = [e for e in b_events if isinstance(e, SampleCompleted) and e.rollout_id == "A"]
        assert sorted(e.sample_id for e in copied) == ["A:s2", "A:s3"]
        archive = tmp_path / "B.archive"
        await archive_rollout(log, "B", archive)
        loaded = read_archive(archive)
        envs, bad = decode_entries(loaded.stream, loaded.entries)
        assert bad == 0
        for name, data_bytes in render_artifacts(replay_state(envs)).items():
            assert (rig.out / "B" / name).read_bytes() == data_bytes, name
    finally:
        await client.aclose()
        await rig.close()
