"""The staleness bound end to end: a real redis-server, a real tinylm subprocess whose weight
version moves (``/update_weights_from_disk``) while a trainer publishes versions on
``rl:control``, and the engine's own worker and finalizer (issue 12, point 4).

* With a gate, deterministic: every sample runs its first turn on version 0; the trainer
  then moves to version 2 with ``max_staleness=1``; no sample runs a second turn -- the worker
  ends each as ``stale`` before generating it -- and the ``RolloutReady`` counts them.
* With a seeded random publish schedule: whatever the interleaving, no kept sample has a
  sampled token older than the recorded trainer version minus the bound, what was excluded
  is counted, the ``RolloutReady`` is re-derived from the log alone, and a replay of the
  archived stream writes the finalizer's files byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.finalizer import Finalizer, FinalizerConfig, decide_ready
from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.agents.binding import EvaluatorBinding
from engine.backends.pool import BackendPool
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason
from engine.events import (
    AbortClass,
    EventLog,
    PolicyVersionPublished,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
)
from engine.events.redis_log import RedisEventLog, RedisSettings
from engine.events.redis_log import connect as redis_connect
from engine.ops.inspection import status_lines
from engine.ops.replay import archive_rollout, decode_entries, read_archive, replay_state
from engine.projections.base import fold, start
from engine.projections.readback import Rollout, in_memory
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.projections.summary import render_artifacts
from tests.actors.play import play_scheduler
from tests.redis_server import RedisServer
from tinylm.process import ServerProcess, spawn_server

EVALUATOR = "turns"


@dataclass
class TurnsAgent(BaseAgent):
    """``turns`` generations on the worker's policy server, an observation token between
    them (mask 0, version -1), each turn's tokens tagged with the version the server
    reported. Optional: a gate before the second turn, a delay before each later turn."""

    turns: int = 3
    gate: asyncio.Event | None = None
    delay: Callable[[int, int], float] | None = None
    first_turns: int = 0
    first_turns_done: asyncio.Event = field(default_factory=asyncio.Event)
    expect_first: int = 0
    versions: dict[str, list[int | None]] = field(default_factory=lambda: defaultdict(list))

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        assert context.backends is not None
        backend = context.backends.get()
        prompt = [1 + task.index % 7, 2, 3]
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns: list[TurnRecord] = []
        for t in range(self.turns):
            if t == 1 and self.gate is not None:
                await self.gate.wait()
            elif t > 0 and self.delay is not None:
                await asyncio.sleep(self.delay(task.index, t))
            gen = await backend.generate(
                input_ids=prompt + response,
                sampling_params={"max_new_tokens": 3, "temperature": 1.0, "ignore_eos": True},
            )
            self.versions[task.sample_id].append(gen.weight_version)
            if t == 0:
                self.first_turns += 1
                if self.first_turns >= self.expect_first:
                    self.first_turns_done.set()
            assert gen.token_ids is not None and gen.logprobs is not None
            n = len(gen.token_ids)
            response += [*gen.token_ids, 4]
            logprobs += [*gen.logprobs, 0.0]
            mask += [1] * n + [0]
            v = gen.weight_version if gen.weight_version is not None else -1
            versions += [v] * n + [-1]
            turns.append(TurnRecord(index=t, prompt_tokens=len(prompt) + len(response),
                                    response_tokens=n, weight_version=gen.weight_version))
        return AgentResult(
            prompt_token_ids=prompt, response_token_ids=response, response_logprobs=logprobs,
            loss_mask=mask, response_versions=versions, turns=tuple(turns),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return float(task.index % 2)


def binding(agent: BaseAgent, concurrency: int = 16) -> dict[str, EvaluatorBinding]:
    profile = EvaluatorProfile(
        evaluator_id=EVALUATOR, resource=Resource(concurrency=concurrency), batch_size=16
    )
    return {EVALUATOR: EvaluatorBinding(profile=profile, agent=agent)}


@dataclass
class Rig:
    """A worker and a finalizer of the engine, in this event loop, on a real redis-server."""

    url: str
    server: ServerProcess | None
    out: Path
    logs: list[RedisEventLog] = field(default_factory=list)
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    worker: EvaluatorWorker | None = None
    backends: BackendPool | None = None

    def log(self) -> RedisEventLog:
        log = RedisEventLog(
            redis_connect(RedisSettings(url=self.url, block_ms=200)), producer="test",
            block_ms=200,
        )
        self.logs.append(log)
        return log

    def start(self, agent: BaseAgent, concurrency: int = 16) -> None:
        config = WorkerConfig(worker_id="w1", evaluator_ids=(EVALUATOR,), heartbeat_ms=100,
                              claim_idle_ms=2000, block_ms=200, grace_s=5.0)
        self.backends = BackendPool(self.server.url if self.server is not None else None)
        self.worker = EvaluatorWorker(
            self.log(), binding(agent, concurrency), config, backends=self.backends,
        )
        finalizer = Finalizer(
            self.log(),
            FinalizerConfig(consumer="f1", out_dir=self.out, heartbeat_ms=100,
                            claim_idle_ms=2000, block_ms=200),
        )
        self.tasks.append(asyncio.create_task(self.worker.run(self.stop)))
        self.tasks.append(asyncio.create_task(finalizer.run(self.stop)))

    async def close(self) -> None:
        self.stop.set()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 15)
        for log in self.logs:
            await log.aclose()
        if self.backends is not None:
            await self.backends.aclose()


@pytest.fixture
def server(tinylm_dir: Path) -> Any:
    with spawn_server(tinylm_dir, extra_args=["--weight-version", "0"]) as proc:
        yield proc
    # The server has exited: close its output pipe here rather than leave it to the garbage
    # collector, whose ResourceWarning can land inside pytest's own AST parsing at the end
    # of the session (CPython 3.11: "AST constructor recursion depth mismatch").
    if proc.process.stdout is not None:
        with contextlib.suppress(Exception):
            proc.process.stdout.close()


@pytest.fixture
async def rig(
    redis_server: RedisServer, server: ServerProcess, tmp_path: Path
) -> AsyncIterator[Rig]:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()
    rig = Rig(redis_server.url, server, tmp_path / "out")
    yield rig
    await rig.close()


async def set_server_version(server: ServerProcess, model: Path, version: int) -> None:
    """What a weight sync does to one server: load the weights, tagged ``version``."""
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(
            server.url + "/update_weights_from_disk",
            json={"model_path": str(model), "weight_version": str(version)},
        )
    assert reply.status_code == 200 and reply.json()["success"], reply.text


async def wait_ready(log: EventLog, rollout_id: str, timeout: float = 90.0) -> RolloutReady:
    async def follow() -> RolloutReady:
        position = "0-0"
        while True:
            envs, position = await log.read_after(log.names.control, position, block_ms=200)
            for env in envs:
                if isinstance(env.event, RolloutReady) and env.event.rollout_id == rollout_id:
                    return env.event

    return await asyncio.wait_for(follow(), timeout)


async def fold_until_ready(log: EventLog, rollout_id: str) -> tuple[RolloutState, Rollout]:
    """The rollout fold up to just before its RolloutReady (what the finalizer decided
    from), and folded up to and including it, with the stream's entries at hand."""
    envs = await log.read_all(log.names.rollout(rollout_id))
    at = next(i for i, e in enumerate(envs) if isinstance(e.event, RolloutReady))
    projection = RolloutProjection()
    before = fold(projection, start(projection), envs[:at]).state
    projection = RolloutProjection()
    upto = fold(projection, start(projection), envs[: at + 1]).state
    return before, in_memory(upto, envs)


def same_decision(a: RolloutReady | None, b: RolloutReady) -> bool:
    """Equal but for the envelope (which process wrote it)."""
    envelope = {"producer", "causation"}
    return a is not None and a.model_dump(exclude=envelope) == b.model_dump(exclude=envelope)


def assert_bound_respected(ready: RolloutReady, rollout: Rollout, bound: int) -> None:
    assert ready.trainer_version is not None
    floor = ready.trainer_version - bound
    state = rollout.state
    for sid in ready.sample_ids:
        done = rollout.completed(state.samples[sid])
        sampled = done.token_versions.numpy()[done.loss_mask.numpy().astype(bool)]
        assert (sampled >= floor).all(), (sid, sampled.tolist(), floor)
    counted = len(ready.sample_ids) + len(ready.dropped_sample_ids) + len(ready.stale_sample_ids)
    assert counted == len(state.samples)


async def test_a_sample_whose_first_turn_fell_behind_the_bound_runs_no_second_turn(
    rig: Rig, tinylm_dir: Path
) -> None:
    gate = asyncio.Event()
    agent = TurnsAgent(turns=3, gate=gate, expect_first=6)
    rig.start(agent)
    log = rig.log()
    request = RolloutRequested(rollout_id="gated", n_prompts=3, n_samples_per_prompt=2,
                               max_staleness=1, policy_version=0)
    await log.append(log.names.control, request)
    await play_scheduler(log, request, evaluator_id=EVALUATOR, batch_size=16)
    await asyncio.wait_for(agent.first_turns_done.wait(), 60)
    # the trainer moves two versions on; a weight sync brings the server to the newest
    for v in (1, 2):
        await log.append(log.names.control, PolicyVersionPublished(version=v))
    assert rig.server is not None
    await set_server_version(rig.server, tinylm_dir, 2)
    assert rig.worker is not None
    await rig.worker.control.wait_for(lambda s: s.published == 2)
    gate.set()
    ready = await wait_ready(log, "gated")
    # every sample ran exactly its first turn, on version 0, and was then ended as stale
    assert sorted(agent.versions) == [f"gated:s{i}" for i in range(6)]
    assert all(v == [0] for v in agent.versions.values())
    before, rollout = await fold_until_ready(log, "gated")
    state = rollout.state
    assert all(r.aborted and r.abort_class is AbortClass.STALE for r in state.ordered())
    assert ready.stale_sample_ids == [f"gated:s{i}" for i in range(6)]
    assert ready.sample_ids == [] and ready.dummy and ready.trainer_version == 2
    assert ready.metrics["class/stale"] == 6.0 and ready.metrics["n_stale"] == 6.0
    assert same_decision(decide_ready(before, ready.trainer_version), ready)
    assert "6 stale" in status_lines(state)[0] and "trainer at v2" in status_lines(state)[0]


@pytest.mark.parametrize("seed", [3, 11])
async def test_a_random_publish_schedule_never_lets_a_stale_token_into_a_ready_rollout(
    rig: Rig, tinylm_dir: Path, tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    delays = {(i, t): rng.uniform(0.0, 0.35) for i in range(16) for t in range(4)}
    schedule = [rng.uniform(0.15, 0.45) for _ in range(4)]
    agent = TurnsAgent(turns=4, delay=lambda i, t: delays[(i, t)])
    rig.start(agent, concurrency=4)  # three waves: later ones start on newer weights
    log = rig.log()
    rid = f"random-{seed}"
    request = RolloutRequested(rollout_id=rid, n_prompts=6, n_samples_per_prompt=2,
                               max_staleness=1, policy_version=0)
    await log.append(log.names.control, request)
    await play_scheduler(log, request, evaluator_id=EVALUATOR, batch_size=16)

    async def trainer() -> None:
        for v, pause in enumerate(schedule, start=1):
            await asyncio.sleep(pause)
            await log.append(log.names.control, PolicyVersionPublished(version=v))
            assert rig.server is not None
            await set_server_version(rig.server, tinylm_dir, v)

    publishing = asyncio.create_task(trainer())
    ready = await wait_ready(log, rid)
    await publishing
    before, rollout = await fold_until_ready(log, rid)
    assert_bound_respected(ready, rollout, bound=1)
    # what the bound excluded is counted, and the decision is the log's alone
    assert same_decision(decide_ready(before, ready.trainer_version), ready)
    stale_ended = [r for r in rollout.state.ordered()
                   if isinstance(rollout.terminal(r), SampleAborted)
                   and r.abort_class is AbortClass.STALE]
    for s in stale_ended:
        assert s.sample_id in ready.stale_sample_ids
        assert len(agent.versions[s.sample_id]) < 4  # it stopped before its last turn
    # replay of the archived stream writes the finalizer's files byte for byte
    archive = tmp_path / "rollout.archive"
    await archive_rollout(log, rid, archive)
    loaded = read_archive(archive)
    envs, bad = decode_entries(loaded.stream, loaded.entries)
    assert bad == 0
    for name, data in render_artifacts(replay_state(envs)).items():
        assert (rig.out / rid / name).read_bytes() == data, name
