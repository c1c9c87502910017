"""What a ``BatchRun`` hands an episode and does around it, on the per-sample hot path:
the attempt's ``tmp_dir`` (made on first read, removed after that attempt's cleanup), the
context copies an agent may make, the phase order and which phases get a timeout scope.
A real ``BatchRun`` with in-process agents; events go to a list."""

from __future__ import annotations

import asyncio
import copy as copy_module
import dataclasses
import pickle
from pathlib import Path

import pytest

from engine.actors.batch_run import BatchPlan, BatchRun, EpisodeSettings
from engine.agents.base import (
    AgentResult,
    BaseAgent,
    Episode,
    EpisodeAgent,
    EpisodeContext,
    Reward,
    TurnRecord,
    noop_phase,
)
from engine.agents.binding import EvaluatorBinding
from engine.domain import EvaluatorProfile, Resource, StoppingCriteria, Task, TerminationReason
from engine.events.base import Event
from engine.events.catalog import (
    AbortClass,
    BatchAdmitted,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TokenReleased,
    TurnCompleted,
)
from engine.events.codec import decode, encode
from engine.events.names import StreamNames
from tests.agents.test_evaluator_wiring import ListSink


def result() -> AgentResult:
    return AgentResult(
        prompt_token_ids=(1, 2), response_token_ids=(3, 4), response_logprobs=(-0.1, -0.2),
        loss_mask=(1, 1), turns=(TurnRecord(index=0, prompt_tokens=2, response_tokens=2),),
        termination_reason=TerminationReason.FINISH,
    )


def plan(n: int, *, tokens: tuple[str, ...] = ()) -> BatchPlan:
    sids = [f"r:s{i}" for i in range(n)]
    tasks = {
        s: TaskFetched(rollout_id="r", sample_id=s, index=i, group_index=i, prompt="p",
                       label="l", dataset="d", task_type="t", source_line=i + 1)
        for i, s in enumerate(sids)
    }
    return BatchPlan(
        admitted=BatchAdmitted(rollout_id="r", batch_id="r:b0", evaluator_id="e",
                               sample_ids=sids, token_ids=list(tokens),
                               nodes={t: "node-a" for t in tokens}),
        request=None, tasks=tasks, run_ids=tuple(sids), attempts={}, tokens=tokens,
    )


async def run_batch(agent: BaseAgent, n: int, tmp_path: Path, *, concurrency: int = 1,
                    tokens: tuple[str, ...] = ()) -> list[Event]:
    sink = ListSink()
    profile = EvaluatorProfile(evaluator_id="e", resource=Resource(concurrency=concurrency))
    run = BatchRun(EvaluatorBinding(profile=profile, agent=agent), plan(n, tokens=tokens),
                   sink=sink, names=StreamNames("rl"),
                   settings=EpisodeSettings(worker_id="w", tmp_root=tmp_path))
    await run.run()
    return sink.events


class DirAgent(BaseAgent):
    """Makes its attempt's directory in ``init`` and records, in ``run``, which directories
    of earlier attempts are still on disk."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.leftover: list[list[Path]] = []

    async def init(self, task: Task, context: EpisodeContext) -> None:
        context.tmp_dir.mkdir(parents=True)
        (context.tmp_dir / "scratch").write_text(task.sample_id)

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        self.leftover.append([d for d in self.dirs if d.exists()])
        self.dirs.append(context.tmp_dir)
        return result()

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


async def test_an_attempts_directory_is_removed_after_its_cleanup_not_at_batch_end(
    tmp_path: Path,
) -> None:
    agent = DirAgent()
    events = await run_batch(agent, 3, tmp_path)  # one at a time
    assert [d.name for d in agent.dirs] == ["r_s0-a1", "r_s1-a1", "r_s2-a1"]
    assert len({d.parent for d in agent.dirs}) == 1  # one per-batch directory
    assert agent.leftover == [[], [], []]  # each earlier attempt's directory was gone
    assert sum(isinstance(e, SampleCompleted) for e in events) == 3
    assert list(tmp_path.iterdir()) == []


class ContextAgent(BaseAgent):
    """Copies its context the way an agent may (``dataclasses.replace``) and reads it."""

    def __init__(self) -> None:
        self.seen: list[tuple[object, ...]] = []

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        copy = dataclasses.replace(context, seed=99)
        deep = copy_module.deepcopy(context)
        pickled = pickle.loads(pickle.dumps(context))
        self.seen.append((context.node, context.attempt, copy.seed, copy.node,
                          copy.tmp_dir == context.tmp_dir, copy == dataclasses.replace(copy),
                          repr(context).startswith("EpisodeContext(rollout_id='r'"),
                          deep.tmp_dir == pickled.tmp_dir == context.tmp_dir, deep == context))
        return result()

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


async def test_the_context_reads_and_copies_like_a_plain_episode_context(tmp_path: Path) -> None:
    agent = ContextAgent()
    await run_batch(agent, 1, tmp_path, tokens=("t0",))
    assert agent.seen == [("node-a", 1, 99, "node-a", True, True, True, True, True)]
    assert list(tmp_path.iterdir()) == []  # read, never made: nothing on disk


class PhaseAgent(BaseAgent):
    """Records the phases it is driven through; fails in ``fail`` when set."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.phases: list[str] = []

    async def _phase(self, name: str) -> None:
        self.phases.append(name)
        if name == self.fail:
            raise RuntimeError(f"{name} failed")

    async def init(self, task: Task, context: EpisodeContext) -> None:
        await self._phase("init")

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        await self._phase("run")
        return result()

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        await self._phase("eval")
        return 1.0

    async def cleanup(self, task: Task, context: EpisodeContext) -> None:
        await self._phase("cleanup")


async def test_the_phases_run_in_order_and_cleanup_runs_after_a_failure(tmp_path: Path) -> None:
    ok = PhaseAgent()
    events = await run_batch(ok, 1, tmp_path, tokens=("t0",))
    assert ok.phases == ["init", "run", "eval", "cleanup"]
    assert [type(e) for e in events] == [SampleStarted, TurnCompleted, SampleCompleted,
                                         TokenReleased]
    for phase in ("init", "run", "eval"):
        agent = PhaseAgent(fail=phase)
        events = await run_batch(agent, 1, tmp_path, tokens=("t0",))
        assert agent.phases[-1] == "cleanup"
        [aborted] = [e for e in events if isinstance(e, SampleAborted)]
        assert aborted.phase == phase and f"{phase} failed" in aborted.error


class SlowCleanupAgent(PhaseAgent):
    async def cleanup(self, task: Task, context: EpisodeContext) -> None:
        self.phases.append("cleanup")
        await asyncio.sleep(3600)


async def test_an_overriding_cleanup_is_still_cut_at_the_cleanup_timeout(tmp_path: Path) -> None:
    agent = SlowCleanupAgent()
    sink = ListSink()
    profile = EvaluatorProfile(evaluator_id="e")
    run = BatchRun(EvaluatorBinding(profile=profile, agent=agent), plan(1), sink=sink,
                   names=StreamNames("rl"),
                   settings=EpisodeSettings(worker_id="w", tmp_root=tmp_path,
                                            cleanup_timeout_s=0.05))
    await asyncio.wait_for(run.run(), 30)
    [aborted] = [e for e in sink.events if isinstance(e, SampleAborted)]
    assert aborted.phase == "cleanup" and agent.phases == ["init", "run", "eval", "cleanup"]


class OwnEpisode(Episode):
    async def run(self, context: EpisodeContext) -> AgentResult:
        return result()

    async def eval(self, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


class CleaningEpisode(OwnEpisode):
    async def cleanup(self, context: EpisodeContext) -> None:
        return None


class EpisodeMaker(EpisodeAgent):
    def __init__(self, cls: type[Episode]) -> None:
        self.cls = cls

    def episode(self, task: Task) -> Episode:
        return self.cls()


def test_noop_phase_tells_the_inherited_no_op_phases_from_overriding_ones() -> None:
    task = Task(sample_id="r:s0", rollout_id="r", index=0, group_index=0, prompt="p",
                dataset_name="d", task_type="t", source_line=1)
    assert noop_phase(ContextAgent().episode(task), "cleanup")
    assert noop_phase(ContextAgent().episode(task), "init")
    assert not noop_phase(PhaseAgent().episode(task), "cleanup")
    assert not noop_phase(PhaseAgent().episode(task), "init")
    assert noop_phase(EpisodeMaker(OwnEpisode).episode(task), "cleanup")
    assert not noop_phase(EpisodeMaker(CleaningEpisode).episode(task), "cleanup")
    assert noop_phase(EpisodeMaker(CleaningEpisode).episode(task), "init")


class OverrunAgent(PhaseAgent):
    """Overruns the episode window in ``slow``; records every phase it enters."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.slow = slow

    async def _phase(self, name: str) -> None:
        self.phases.append(name)
        if name == self.slow:
            await asyncio.sleep(3600)


def windowed_plan(window_s: float) -> BatchPlan:
    base = plan(1, tokens=("t0",))
    [(sid, task)] = base.tasks.items()
    task = task.model_copy(update={"stopping": StoppingCriteria(timeout_s=window_s)})
    return dataclasses.replace(base, tasks={sid: task})


@pytest.mark.parametrize("slow", ["init", "run", "eval"])
async def test_a_phase_that_overruns_the_window_is_aborted_as_agent_timeout(
    slow: str, tmp_path: Path
) -> None:
    agent = OverrunAgent(slow)
    sink = ListSink()
    run = BatchRun(EvaluatorBinding(profile=EvaluatorProfile(evaluator_id="e"), agent=agent),
                   windowed_plan(0.2), sink=sink, names=StreamNames("rl"),
                   settings=EpisodeSettings(worker_id="w", tmp_root=tmp_path))
    await asyncio.wait_for(run.run(), 30)
    [aborted] = [e for e in sink.events if isinstance(e, SampleAborted)]
    assert (aborted.abort_class, aborted.phase) == (AbortClass.AGENT_TIMEOUT, slow)
    assert f"elapsed during {slow}" in aborted.error
    assert aborted.window_s == 0.2 and aborted.elapsed_s >= 0.2
    assert agent.phases[-1] == "cleanup" and agent.phases.count("cleanup") == 1
    # SampleStarted once the token is held: after init, so not for an init that overran
    assert any(isinstance(e, SampleStarted) for e in sink.events) == (slow != "init")


class InitClockAgent(BaseAgent):
    """An init that (on the fake clock) takes the whole episode window."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.ran = False

    async def init(self, task: Task, context: EpisodeContext) -> None:
        self.clock[0] += 5.0

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        self.ran = True
        return result()

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


async def test_a_window_spent_by_init_aborts_the_run_before_it_starts(tmp_path: Path) -> None:
    """init ends exactly as the window does: run is not started, and the abort names the
    phase it did not get to (run), as the message does."""
    now = [0.0]
    agent = InitClockAgent(now)
    sink = ListSink()
    run = BatchRun(EvaluatorBinding(profile=EvaluatorProfile(evaluator_id="e"), agent=agent),
                   windowed_plan(5.0), sink=sink, names=StreamNames("rl"),
                   settings=EpisodeSettings(worker_id="w", tmp_root=tmp_path),
                   clock=lambda: now[0])
    await asyncio.wait_for(run.run(), 30)
    [aborted] = [e for e in sink.events if isinstance(e, SampleAborted)]
    assert (aborted.abort_class, aborted.phase) == (AbortClass.AGENT_TIMEOUT, "run")
    assert "elapsed before run" in aborted.error and not agent.ran


async def test_sample_started_equals_its_validated_construction(tmp_path: Path) -> None:
    events = await run_batch(ContextAgent(), 2, tmp_path, concurrency=2, tokens=("t0", "t1"))
    started = [e for e in events if isinstance(e, SampleStarted)]
    assert sorted(e.sample_id for e in started) == ["r:s0", "r:s1"]
    for event in started:
        reference = SampleStarted(**{k: getattr(event, k) for k in event.model_fields_set})
        assert event == reference and event.node == "node-a" and event.worker == "w"
        assert list(event.__dict__) == list(reference.__dict__)
        assert event.model_fields_set == reference.model_fields_set
        assert encode(event) == encode(reference) and decode(encode(event)) == event
