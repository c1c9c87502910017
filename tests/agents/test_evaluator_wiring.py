"""The bundled evaluators run by a worker's real ``BatchRun``: the tinylm server over sockets,
the local sandbox through the worker's labelled provider, events out.

This pins the contract between the bundled evaluator config (profiles bound to agents, as a
worker loads them) and the evaluator: the episode context it
builds is enough for the agent, the reward dict is accepted, and a finished episode becomes a
``SampleCompleted`` carrying the trajectory (not a ``SampleAborted``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from engine.actors.batch_run import BatchPlan, BatchRun, EpisodeSettings
from engine.backends.pool import BackendPool
from engine.config.evaluators import load_evaluators
from engine.events.base import Event
from engine.events.catalog import BatchAdmitted, SampleCompleted, TaskFetched, TurnCompleted
from engine.events.names import StreamNames
from engine.sandbox import LocalSandboxProvider
from engine.tasks import EVALUATOR_CONFIG
from engine.tasks.evaluators import DEFAULT_STOPPING
from tests.agents.conftest import MATH_QUESTION
from tinylm.server import TinyLMServer


class ListSink:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, items: Sequence[tuple[str, Event]]) -> None:
        self.events.extend(event for _, event in items)

    async def flush(self) -> None:
        return None


def fetched(sample_id: str, index: int, prompt: str, label: str, task_type: str) -> TaskFetched:
    return TaskFetched(
        rollout_id="rw",
        sample_id=sample_id,
        index=index,
        group_index=index,
        prompt=prompt,
        label=label,
        dataset=f"{task_type}_train",
        task_type=task_type,
        source_line=index + 1,
        # what the planner resolves: the profile's default stopping, greedy sampling
        stopping=DEFAULT_STOPPING,
        sampling_params={"temperature": 0.0},
    )


async def run_one(
    evaluator_id: str,
    task: TaskFetched,
    *,
    model_dir: Path,
    server: TinyLMServer,
    provider: LocalSandboxProvider,
    tmp_path: Path,
) -> list[Event]:
    specs = load_evaluators(EVALUATOR_CONFIG, {"model_dir": str(model_dir)})
    sink = ListSink()
    plan = BatchPlan(
        admitted=BatchAdmitted(
            rollout_id="rw",
            batch_id=f"rw:b{task.index}",
            evaluator_id=evaluator_id,
            sample_ids=[task.sample_id],
        ),
        request=None,
        tasks={task.sample_id: task},
        run_ids=(task.sample_id,),
        attempts={},
        tokens=(),
    )
    async with BackendPool(server.url) as backends:
        evaluator = BatchRun(
            specs[evaluator_id],
            plan,
            sink=sink,
            names=StreamNames("rl"),
            settings=EpisodeSettings(worker_id="w-agents", tmp_root=tmp_path),
            backends=backends,
            sandboxes=provider,
        )
        await evaluator.run()
    assert await provider.find({"rollout.worker": "w-agents"}) == []  # cleanup stopped it
    return sink.events


async def test_math_sample_completes_with_its_trajectory_and_reward(
    model_dir: Path, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    task = fetched("rw:s0", 0, MATH_QUESTION, "42", "math")
    events = await run_one(
        "math", task, model_dir=model_dir, server=server, provider=provider, tmp_path=tmp_path
    )
    turns = [e for e in events if isinstance(e, TurnCompleted)]
    [done] = [e for e in events if isinstance(e, SampleCompleted)]
    assert [t.tool_calls for t in turns] == [["python"], []]
    assert done.termination_reason == "finish" and done.status == "completed"
    assert done.reward == 1.0 and done.reward_detail["exact_match"] == 1.0
    assert done.metrics["n_tool_calls"] == 1.0
    mask = done.loss_mask.tolist()
    assert len(mask) == len(done.response_ids.tolist()) == len(done.logprobs.tolist())
    assert 0 in mask and 1 in mask


async def test_shell_sample_is_scored_by_its_check(
    model_dir: Path, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    # The model only knows the math episode, so it cannot pass the check; the check still
    # runs in the episode's sandbox and scores the sample (completed, reward 0).
    task = fetched("rw:s1", 1, "Create a directory named cache.", "test -d cache", "shell")
    events = await run_one(
        "shell", task, model_dir=model_dir, server=server, provider=provider, tmp_path=tmp_path
    )
    [done] = [e for e in events if isinstance(e, SampleCompleted)]
    assert done.status in ("completed", "truncated")
    assert done.reward == 0.0 and done.reward_detail["exit_code"] == 1.0
