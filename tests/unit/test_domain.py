from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext
from engine.agents.binding import EvaluatorBinding
from engine.domain import (
    Batch,
    DatasetConfig,
    DatasetEntry,
    EvalDatasetConfig,
    EvaluatorProfile,
    Resource,
    SampleStatus,
    SamplingParams,
    StoppingCriteria,
    Task,
    TerminationReason,
    overlay,
    sample_id_for,
)
from engine.errors import ConfigError
from engine.outcomes import AbortClass, FailureClass
from tests.fakes import FixedAgent


def _dataset(**overrides: object) -> DatasetEntry:
    fields: dict[str, object] = {"name": "math", "path": Path("/d/math.jsonl"), "task_type": "m"}
    fields.update(overrides)
    return DatasetEntry.model_validate(fields)


def _task(index: int = 0, dataset: DatasetConfig | None = None, **overrides: object) -> Task:
    """A task of ``dataset`` (default ``_dataset()``): its name and task type."""
    dataset = _dataset() if dataset is None else dataset
    fields: dict[str, object] = {
        "sample_id": sample_id_for("r1", index),
        "rollout_id": "r1",
        "index": index,
        "group_index": index,
        "prompt": "2+2?",
        "label": "4",
        "dataset_name": dataset.name,
        "task_type": dataset.task_type,
        "source_line": 1,
    }
    fields.update(overrides)
    return Task.model_validate(fields)


class TestResource:
    @pytest.mark.parametrize("gpu", [0, 0.25, 0.33, 1, 2, 8])
    def test_accepts_fractions_and_whole_gpus(self, gpu: float) -> None:
        assert Resource(gpu=gpu).gpu == gpu

    @pytest.mark.parametrize("gpu", [-0.1, 1.5, float("nan")])
    def test_refuses_negative_and_fractional_multi_gpu(self, gpu: float) -> None:
        with pytest.raises(ValidationError):
            Resource(gpu=gpu)

    def test_refuses_zero_concurrency_and_string_numbers(self) -> None:
        with pytest.raises(ValidationError):
            Resource(concurrency=0)
        with pytest.raises(ValidationError):
            Resource.model_validate({"cpu": "4"})

    def test_peak_is_per_field_max(self) -> None:
        a = Resource(gpu=0.5, cpu=4, memory_gb=8, concurrency=1)
        b = Resource(gpu=0.25, cpu=8, memory_gb=2, concurrency=3)
        assert a.peak(b) == Resource(gpu=0.5, cpu=8, memory_gb=8, concurrency=3)

    def test_is_immutable(self) -> None:
        with pytest.raises(ValidationError):
            Resource().cpu = 3  # type: ignore[misc]


class TestEvaluatorProfile:
    def test_sample_resource_is_per_field_max_of_run_and_eval(self) -> None:
        spec = EvaluatorProfile(
            evaluator_id="swe",
            resource=Resource(cpu=96, memory_gb=320, concurrency=4),
            run_resource=Resource(cpu=4, memory_gb=16, gpu=0.5),
            eval_resource=Resource(cpu=8, memory_gb=12),
        )
        assert spec.sample_resource == Resource(gpu=0.5, cpu=8, memory_gb=16, concurrency=1)

    def test_defaults(self) -> None:
        spec = EvaluatorProfile(evaluator_id="swe")
        assert spec.batch_size is None
        assert spec.default_stopping == StoppingCriteria()
        assert spec.sample_resource == Resource()

    def test_a_binding_needs_an_agent(self) -> None:
        with pytest.raises(ConfigError, match="evaluator 'swe': the agent must be a BaseAgent"):
            EvaluatorBinding(profile=EvaluatorProfile(evaluator_id="swe"), agent=object())  # type: ignore[arg-type]
        binding = EvaluatorBinding(profile=EvaluatorProfile(evaluator_id="swe"), agent=FixedAgent())
        assert binding.evaluator_id == "swe"

    def test_a_profile_is_pure_data(self) -> None:
        # The scheduler reads profiles without building agents: no field holds one.
        assert not any(
            isinstance(getattr(EvaluatorProfile(evaluator_id="swe"), f.name), BaseAgent)
            for f in dataclasses.fields(EvaluatorProfile)
        )
        assert "handler" not in {f.name for f in dataclasses.fields(EvaluatorProfile)}

    @pytest.mark.parametrize("batch_size", [0, -1, True, 2.0])
    def test_batch_size_must_be_positive_int(self, batch_size: object) -> None:
        with pytest.raises(ConfigError, match="evaluator 'swe': batch_size"):
            EvaluatorProfile(evaluator_id="swe", batch_size=batch_size)  # type: ignore[arg-type]

    @pytest.mark.parametrize("bad_id", ["", "has space", "a:b", "-lead"])
    def test_id_must_be_a_stream_safe_name(self, bad_id: str) -> None:
        with pytest.raises(ConfigError, match="evaluator_id"):
            EvaluatorProfile(evaluator_id=bad_id)


class TestSamplingParams:
    def test_max_new_tokens_belongs_to_stopping(self) -> None:
        with pytest.raises(ValidationError, match="max_new_tokens is a stopping criterion"):
            SamplingParams.model_validate({"max_new_tokens": 10})

    def test_unknown_name_refused(self) -> None:
        with pytest.raises(ValidationError, match="temprature"):
            SamplingParams.model_validate({"temprature": 0.7})

    def test_single_stop_string_and_request_mapping(self) -> None:
        params = SamplingParams.model_validate({"temperature": 1, "stop": "</s>", "top_k": -1})
        assert params.stop == ("</s>",)
        assert params.as_request() == {"temperature": 1.0, "stop": ["</s>"], "top_k": -1}

    @pytest.mark.parametrize(
        "fields", [{"top_p": 0}, {"top_p": 1.5}, {"top_k": 0}, {"temperature": -1}]
    )
    def test_ranges(self, fields: dict[str, object]) -> None:
        with pytest.raises(ValidationError):
            SamplingParams.model_validate(fields)


class TestOverlay:
    def test_fine_level_wins_only_where_set(self) -> None:
        coarse = StoppingCriteria(max_turns=10, max_context_len=1000, timeout_s=60)
        fine = StoppingCriteria(max_context_len=500, max_new_tokens=64)
        assert overlay(coarse, fine) == StoppingCriteria(
            max_turns=10, max_context_len=500, max_new_tokens=64, timeout_s=60
        )

    def test_empty_fine_level_keeps_coarse(self) -> None:
        coarse = SamplingParams(temperature=0.5)
        assert overlay(coarse, SamplingParams()) is coarse


class TestTerminationReason:
    def test_statuses(self) -> None:
        assert TerminationReason.FINISH.status is SampleStatus.COMPLETED
        assert TerminationReason.MAX_TURNS.status is SampleStatus.TRUNCATED
        assert TerminationReason.MAX_CONTEXT.status is SampleStatus.TRUNCATED
        assert TerminationReason.AGENT_TIMEOUT.status is SampleStatus.ABORTED
        assert TerminationReason.INFRA_SANDBOX.is_abort
        assert not TerminationReason.LENGTH.is_abort


class TestOutcomeFamily:
    """Termination reason -> abort class -> failure class, and the status: one family."""

    def test_abort_classes_are_exactly_the_abort_reasons(self) -> None:
        aborts = {r for r in TerminationReason if r.is_abort}
        assert {c.reason for c in AbortClass} == aborts
        for reason in TerminationReason:
            cls = reason.abort_class
            assert (cls is not None) == reason.is_abort
            if cls is not None:
                assert cls.value == reason.value and cls.reason is reason
                assert reason.status is SampleStatus.ABORTED

    def test_every_abort_is_its_own_failure_class_whatever_the_reward(self) -> None:
        for cls in AbortClass:
            assert cls.failure_class.value == cls.value
            assert cls.reason.failure_class(1.0) is cls.failure_class

    def test_agent_reasons_fold_by_reward(self) -> None:
        assert TerminationReason.MAX_TURNS.failure_class(0.5) is FailureClass.SUCCESS
        assert TerminationReason.MAX_TURNS.failure_class(0.0) is FailureClass.TRUNCATED_TURNS
        assert TerminationReason.LENGTH.failure_class(0.0) is FailureClass.TRUNCATED_CONTEXT
        assert TerminationReason.FINISH.failure_class(0.0) is FailureClass.WRONG_ANSWER
        assert FailureClass.of(0.0, None) is FailureClass.WRONG_ANSWER
        assert FailureClass.of(1.0, None).correct

    def test_wire_strings_are_unchanged(self) -> None:
        # archives store these strings; renaming one would orphan old events
        assert [r.value for r in TerminationReason] == [
            "finish", "length", "max_turns", "max_context",
            "agent_timeout", "infra_conn", "infra_sandbox", "infra_other",
            "stale", "tail_aborted",  # appended, the older strings unchanged
            "version_span",
        ]
        assert [s.value for s in SampleStatus] == [
            "pending", "completed", "truncated", "aborted", "failed",
        ]


class TestDatasets:
    def test_stopping_view_of_dataset_overrides(self) -> None:
        entry = _dataset(max_context_len=32768, max_turns=5)
        assert entry.stopping == StoppingCriteria(max_turns=5, max_context_len=32768)
        assert entry.copies_per_prompt == 1

    def test_eval_copies(self) -> None:
        entry = EvalDatasetConfig(
            name="aime", path=Path("/a.jsonl"), task_type="m", n_samples_per_eval_prompt=4
        )
        assert entry.copies_per_prompt == 4

    def test_task_round_trips_through_json(self) -> None:
        eval_entry = EvalDatasetConfig(name="aime", path=Path("/a.jsonl"), task_type="m")
        for task in (_task(), _task(dataset=eval_entry)):
            again = Task.model_validate_json(task.model_dump_json())
            assert again == task
            assert again.dataset_name == task.dataset_name


class TestTask:
    def test_chat_prompt_and_properties(self) -> None:
        task = _task(prompt=[{"role": "user", "content": "hi"}])
        assert task.task_type == "m"
        assert task.dataset_name == "math"

    @pytest.mark.parametrize("prompt", [3, [], [{"content": "no role"}], ["text"]])
    def test_bad_prompts_refused(self, prompt: object) -> None:
        with pytest.raises(ValidationError, match="prompt|chat message"):
            _task(prompt=prompt)


class TestBatch:
    def test_refuses_mixed_task_types(self) -> None:
        other = _task(1, dataset=_dataset(name="code", task_type="c"))
        with pytest.raises(ValidationError, match="of task type 'c'"):
            Batch(batch_id="b", task_type="m", tasks=(_task(0), other))

    def test_refuses_mixed_rollouts_and_empty(self) -> None:
        with pytest.raises(ValidationError, match="mixes rollouts"):
            Batch(batch_id="b", task_type="m", tasks=(_task(0), _task(1, rollout_id="r2")))
        with pytest.raises(ValidationError):
            Batch(batch_id="b", task_type="m", tasks=())


class TestAgentContract:
    def test_agent_result_arrays_must_line_up(self) -> None:
        with pytest.raises(ValidationError, match="loss_mask has 1 entries for 2"):
            AgentResult(
                response_token_ids=(1, 2),
                loss_mask=(1,),
                termination_reason=TerminationReason.FINISH,
            )
        with pytest.raises(ValidationError, match="logprobs have 1 entries for 2"):
            AgentResult(
                response_token_ids=(1, 2),
                response_logprobs=(-1.0,),
                loss_mask=(1, 1),
                termination_reason=TerminationReason.FINISH,
            )
        with pytest.raises(ValidationError, match="0 or 1"):
            AgentResult(response_token_ids=(1,), loss_mask=(2,), termination_reason="finish")

    def test_agent_result_without_logprobs_is_allowed(self) -> None:
        result = AgentResult(
            response_token_ids=(1, 2), loss_mask=(1, 0), termination_reason="max_turns"
        )
        assert not result.has_logprobs
        assert result.termination_reason is TerminationReason.MAX_TURNS

    def test_base_agent_needs_run_and_eval(self) -> None:
        class Half(BaseAgent):
            async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
                raise NotImplementedError

        with pytest.raises(TypeError):
            Half()  # type: ignore[abstract]

    async def test_lifecycle_defaults(self, tmp_path: Path) -> None:
        agent = FixedAgent(reward={"score": 1.0})
        context = EpisodeContext(
            rollout_id="r1",
            sample_id="r1:s0",
            attempt=1,
            stopping=StoppingCriteria(max_turns=3),
            sampling_params=SamplingParams(temperature=1.0),
            tmp_dir=tmp_path,
        )
        task = _task()
        await agent.init(task, context)  # the defaults do nothing and do not fail
        result = await agent.run(task, context)
        assert await agent.eval(task, context, result) == {"score": 1.0}
        await agent.cleanup(task, context)

    def test_context_validates_attempt_and_beta(self, tmp_path: Path) -> None:
        fields: dict[str, Any] = {
            "rollout_id": "r1",
            "sample_id": "s",
            "stopping": StoppingCriteria(),
            "sampling_params": SamplingParams(),
            "tmp_dir": tmp_path,
        }
        with pytest.raises(ValueError, match="attempt counts from 1"):
            EpisodeContext(attempt=0, **fields)
        with pytest.raises(ValueError, match="dagger_beta"):
            EpisodeContext(attempt=1, dagger_beta=1.5, **fields)
