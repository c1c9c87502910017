"""slime's rollout function and manager over the engine (integrations.slime).

slime is not on PyPI and does not import here: the tests hold the adapter to a field-by-field
contract taken from slime's source (THUDM/slime at 624b824a8):

* ``slime/utils/types.py`` ``Sample``: the dataclass's fields and ``Sample.Status``
  (mirrored by ``SlimeSample`` below: an unknown keyword fails its constructor);
* ``slime/ray/rollout.py`` ``RolloutManager._convert_samples_to_train_data``: what it reads of
  each sample (``tokens``, ``response_length``, ``loss_mask`` as long as the response,
  ``remove_sample``, ``get_reward_value``, ``status == Sample.Status.TRUNCATED``, ``index``,
  ``rollout_id``, ``rollout_log_probs``, ``teacher_log_probs``, ``train_metadata``,
  ``multimodal_train_inputs``, ``rollout_routed_experts``, ``metadata``), replayed by
  ``slime_train_data``;
* ``slime/observability/rollout_data_utils.py`` ``validate_rollout_id_annotated``: a
  ``list[list[Sample]]`` (prompt x sample) needs no ``rollout_id``;
* ``slime/utils/data.py`` ``get_source``: ``metadata["source_name"]``;
* ``slime/rollout/base_types.py`` ``call_rollout_fn``: ``fn(args, rollout_id, data_source,
  evaluation=...)``, a plain list (train) or dict (eval) wrapped as the output;
* ``slime/rollout/sglang_rollout.py`` ``eval_rollout_single_dataset``: the eval data is
  ``{name: {"rewards", "truncated", "samples"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.client import RolloutClient
from engine.config.evaluators import load_evaluators
from engine.domain import Task, TerminationReason
from engine.events import RolloutRequested
from engine.events.memory_log import MemoryEventLog, MemoryStore
from integrations.slime import (
    ClientSource,
    SchedulerRolloutManager,
    generate_rollout,
    slime_sample_class,
    to_slime,
    to_slime_groups,
)
from tests.actors.play import play_scheduler
from tests.integrations.conftest import tool_episode
from tests.rig import EVALUATOR_CONFIG, Engine


@dataclass
class SlimeSample:
    """slime/utils/types.py ``Sample``: its fields and defaults (the nested info classes,
    which the adapter leaves at their defaults, are omitted)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | None = None
    rollout_top_p_token_offsets: list[int] | None = None
    rollout_routed_experts: list[list[int]] | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None


def slime_train_data(samples: list[SlimeSample], reward_key: str | None = None) -> dict[str, Any]:
    """What ``RolloutManager._convert_samples_to_train_data`` reads of each sample, with its
    assertions (the group normalization and the DP split aside)."""
    for s in samples:
        assert s.loss_mask is not None and len(s.loss_mask) == s.response_length
        assert len(s.tokens) >= s.response_length
        assert s.rollout_routed_experts is None and s.multimodal_train_inputs is None
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "raw_reward": [s.reward if not reward_key else s.reward[reward_key]  # type: ignore[index]
                       for s in samples],
        "truncated": [1 if s.status == SlimeSample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": [s.rollout_id for s in samples],
        "loss_masks": [[0] * s.response_length if s.remove_sample else s.loss_mask
                       for s in samples],
        "rollout_log_probs": [s.rollout_log_probs for s in samples],
        "source_names": [s.metadata.get("source_name") or "unknown" for s in samples],
    }


def test_an_engine_sample_becomes_slimes_sample_field_by_field() -> None:
    sample = tool_episode(0, 2, teacher=[-1.0] * 7)
    s = to_slime(sample, SlimeSample)
    assert (s.group_index, s.index, s.rollout_id) == (2, 0, None)
    assert s.tokens == [11, 12, 13, 20, 21, 30, 31, 32, 22, 23] and s.response_length == 7
    assert s.loss_mask == [1, 1, 0, 0, 0, 1, 1]  # the tool output is not trained on
    assert s.rollout_log_probs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.5, -0.125]
    assert s.teacher_log_probs == [-1.0] * 7
    assert s.reward == 1.0 and s.status is SlimeSample.Status.COMPLETED
    assert s.prompt == "Compute 2 plus 3." and s.response.startswith("a call")
    assert s.weight_versions == ["3", "3"]  # one per model turn
    assert s.metadata["source_name"] == "math_train"
    assert s.metadata["engine_sample_id"] == "r:s0" and s.metadata["engine_policy_version"] == 3
    assert not s.remove_sample and s.train_metadata is None
    # Every status slime knows maps by name.
    assert {m.value for m in SlimeSample.Status} == {
        "pending", "completed", "truncated", "aborted", "failed"}


def test_groups_are_prompt_by_sample_and_pass_slimes_train_data_checks() -> None:
    from engine.sample import Sample

    dummy = Sample.masked_dummy(policy_version=3).model_copy(update={"index": 3,
                                                                      "group_index": 1})
    samples = [tool_episode(2, 1, reward=0.0), dummy, tool_episode(1, 0), tool_episode(0, 0)]
    groups = to_slime_groups(samples, SlimeSample)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    flat = [s for g in groups for s in g]
    data = slime_train_data(flat)
    assert data["raw_reward"] == [1.0, 1.0, 0.0, 0.0]
    assert data["loss_masks"][3] == [0, 0] and flat[3].remove_sample
    assert flat[3].status is SlimeSample.Status.ABORTED
    assert data["rollout_ids"] == [None] * 4  # depth-2 output: no rollout_id required
    assert data["source_names"][:3] == ["math_train"] * 3


def test_slime_sample_class_names_what_is_missing() -> None:
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="slime does not import here"):
        slime_sample_class()
    params = list(inspect.signature(generate_rollout).parameters)
    assert params == ["args", "rollout_id", "data_source", "evaluation"]
    assert inspect.signature(generate_rollout).parameters["evaluation"].default is False


class ToolAgent(BaseAgent):
    """A two-turn tool episode: a call, the tool's output (masked), the answer; reward 1 when
    the task's label is "5"; ``fail`` in the metadata makes ``run`` raise."""

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if task.metadata.get("fail"):
            raise RuntimeError("scripted failure")
        return AgentResult(
            prompt_token_ids=(1, 2, 3 + task.group_index),
            response_token_ids=(20, 21, 30, 31, 22),
            response_logprobs=(-0.5, -0.25, 0.0, 0.0, -0.125),
            response_versions=(context.policy_version,) * 2 + (-1, -1)
            + (context.policy_version,),
            loss_mask=(1, 1, 0, 0, 1),
            turns=(TurnRecord(index=0, prompt_tokens=3, response_tokens=2, tool_calls=("py",)),
                   TurnRecord(index=1, prompt_tokens=7, response_tokens=1)),
            termination_reason=TerminationReason.FINISH,
            text="5",
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0 if result.text == task.label else 0.0


def tasks(rollout_id: int, n_prompts: int, per_prompt: int) -> list[Task]:
    return [
        Task(sample_id=f"b{rollout_id}:s{i}", rollout_id=f"b{rollout_id}", index=i,
             group_index=i // per_prompt, prompt="2 + 3?", label="5" if i % 2 else "6",
             dataset_name="toy", task_type="math", source_line=1 + i // per_prompt,
             metadata={"dataset": "toy", "fail": i == 3})
        for i in range(n_prompts * per_prompt)
    ]


def test_the_bypass_runs_the_agents_in_process_with_no_log() -> None:
    args = argparse.Namespace(rollout_batch_size=2, n_samples_per_prompt=2, rollout_seed=1)
    manager = SchedulerRolloutManager.bypass(
        args, ToolAgent(), tasks, sample_cls=SlimeSample,
        eval_tasks=lambda rid, _n, _k: tasks(rid, 1, 2))
    try:
        flat, metrics = manager._get_rollout_data(4)
        evaluated = manager.eval(4)
    finally:
        manager.dispose()
    assert [s.index for s in flat] == [0, 1, 2, 3]
    assert [s.group_index for s in flat] == [0, 0, 1, 1]
    assert [s.reward for s in flat] == [0.0, 1.0, 0.0, 0.0]
    assert flat[1].loss_mask == [1, 1, 0, 0, 1] and flat[1].weight_versions == ["4", "4"]
    assert flat[3].remove_sample and flat[3].status is SlimeSample.Status.ABORTED
    assert metrics == {"rollout/samples": 4, "rollout/removed": 1, "rollout/reward": 1 / 3}
    assert list(evaluated) == ["toy"] and evaluated["toy"]["rewards"] == [0.0, 1.0]
    assert evaluated["toy"]["truncated"] == [False, False]
    slime_train_data(flat)


async def test_the_client_source_turns_an_engine_rollout_into_slime_groups() -> None:
    store = MemoryStore()
    engine = Engine(lambda: MemoryEventLog(store, producer="test", block_ms=100,
                                           max_deliveries=3),
                    load_evaluators(EVALUATOR_CONFIG, None))
    engine.start_worker()
    engine.start_finalizer()
    log = MemoryEventLog(store, producer="test", block_ms=100)

    async def scheduler() -> None:  # the scheduler's part, played for the one request
        while True:
            found = [e.event for e in await log.read_all(log.names.control)
                     if isinstance(e.event, RolloutRequested)]
            if found:
                await play_scheduler(log, found[0],
                                     script=lambda i: {"turns": 2, "version": 5,
                                                       "reward": float(i % 2)})
                return
            await asyncio.sleep(0.02)

    source = ClientSource(RolloutClient(MemoryEventLog(store, producer="slime", block_ms=100)),
                          timeout_s=30)
    try:
        played = asyncio.create_task(scheduler())
        samples = await source.train(5, n_prompts=2, n_samples_per_prompt=2, seed=7)
        await played
    finally:
        await source.aclose()
        await engine.close()
    (request,) = [e.event for e in await log.read_all(log.names.control)
                  if isinstance(e.event, RolloutRequested)]
    assert (request.iteration, request.policy_version, request.seed) == (5, 5, 7)
    assert (request.n_prompts, request.n_samples_per_prompt) == (2, 2)
    groups = to_slime_groups(samples, SlimeSample)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]]
    flat = [s for g in groups for s in g]
    assert [s.reward for s in flat] == [0.0, 1.0, 0.0, 1.0]
    assert all(s.response_length == 8 and s.weight_versions == ["5"] for s in flat)
    assert slime_train_data(flat)["source_names"] == ["ds"] * 4


@pytest.mark.redis_server
@pytest.mark.parametrize("log_backend", ["redis-server"])
async def test_generate_rollout_is_slimes_entry_point_over_the_engine(
    make_log: Any, redis_server: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """slime calls ``generate_rollout`` synchronously (its own event loop is not running):
    here from a thread, while the engine's worker and finalizer run on the test's loop, all
    on one redis-server, the manager connecting on the engine's settings."""
    monkeypatch.setenv("ROLLOUT_REDIS_URL", redis_server.url)
    monkeypatch.delenv("ROLLOUT_STREAM_PREFIX", raising=False)
    engine = Engine(lambda: make_log(producer="test", block_ms=100, max_deliveries=3),
                    load_evaluators(EVALUATOR_CONFIG, None))
    engine.start_worker()
    engine.start_finalizer()
    log = make_log(producer="test", block_ms=100)
    args = argparse.Namespace(rollout_batch_size=2, n_samples_per_prompt=3, rollout_seed=0)

    async def scheduler() -> RolloutRequested:
        while True:
            found = [e.event for e in await log.read_all(log.names.control)
                     if isinstance(e.event, RolloutRequested)]
            if found:
                await play_scheduler(log, found[0], script=lambda i: {"turns": 3, "version": 2})
                return found[0]
            await asyncio.sleep(0.02)

    def slime_calls() -> list[list[Any]]:
        from integrations import slime

        manager = SchedulerRolloutManager(args, sample_cls=SlimeSample)
        slime._MANAGERS[id(args)] = manager  # what generate_rollout would build, our Sample
        try:
            out = generate_rollout(args, 2, data_source=None)
            assert isinstance(out, list)
            return out
        finally:
            del slime._MANAGERS[id(args)]
            manager.dispose()

    try:
        played = asyncio.create_task(scheduler())
        groups = await asyncio.to_thread(slime_calls)
        request = await played
    finally:
        await engine.close()
    assert (request.iteration, request.policy_version) == (2, 2)
    assert (request.n_prompts, request.n_samples_per_prompt) == (2, 3)
    assert [[s.index for s in g] for g in groups] == [[0, 1, 2], [3, 4, 5]]
    flat = [s for g in groups for s in g]
    assert all(s.weight_versions == ["2"] and s.response_length == 12 for s in flat)
    slime_train_data(flat)
