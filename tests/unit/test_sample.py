from __future__ import annotations

import pytest
from pydantic import ValidationError

from engine.agents.base import AgentResult
from engine.domain import SampleStatus, Task, TerminationReason
from engine.errors import AgentError
from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.sample import Sample


def _task() -> Task:
    return Task(
        sample_id="r1:s7",
        rollout_id="r1",
        index=7,
        group_index=3,
        prompt=[{"role": "user", "content": "fix the bug"}],
        label="django-123",
        dataset_name="swe_gym",
        task_type="swe",
        source_line=12,
        metadata={"repo": "django"},
    )


def _result(**overrides: object) -> AgentResult:
    fields: dict[str, object] = {
        "prompt_token_ids": (10, 11, 12),
        "response_token_ids": (20, 21),
        "response_logprobs": (-0.1, -0.2),
        "loss_mask": (1, 0),
        "termination_reason": TerminationReason.MAX_TURNS,
        "text": "patch",
    }
    fields.update(overrides)
    return AgentResult.model_validate(fields)


def test_from_agent_result_concatenates_tokens_and_keeps_identity() -> None:
    sample = Sample.from_agent_result(_task(), _result(), {"score": 1.0}, policy_version=4)
    assert sample.tokens == (10, 11, 12, 20, 21)
    assert sample.response_length == 2
    assert sample.loss_mask == (1, 0)
    assert sample.rollout_log_probs == (-0.1, -0.2)
    assert sample.reward == {"score": 1.0}
    assert sample.status is SampleStatus.TRUNCATED
    assert sample.termination_reason is TerminationReason.MAX_TURNS
    assert (sample.index, sample.group_index, sample.sample_id) == (7, 3, "r1:s7")
    assert sample.label == "django-123"
    assert sample.response == "patch"
    assert sample.policy_version == 4
    assert sample.metadata == {"repo": "django", "task_type": "swe", "dataset": "swe_gym"}
    assert not sample.remove_sample


def test_training_sample_needs_logprobs_for_every_response_token() -> None:
    result = _result(response_logprobs=())
    with pytest.raises(AgentError, match=r"task r1:s7 \(dataset 'swe_gym'\).*0 entries for 2"):
        Sample.from_agent_result(_task(), result, 1.0)


def test_training_sample_needs_a_response() -> None:
    result = _result(response_token_ids=(), response_logprobs=(), loss_mask=())
    with pytest.raises(AgentError, match="task r1:s7.*no response tokens"):
        Sample.from_agent_result(_task(), result, 1.0)


def test_eval_sample_may_lack_token_data() -> None:
    result = _result(prompt_token_ids=(), response_token_ids=(), response_logprobs=(), loss_mask=())
    sample = Sample.from_agent_result(_task(), result, 0.0, require_tokens=False)
    assert sample.rollout_log_probs is None
    assert sample.response_length == 0


def test_masked_dummy_shape() -> None:
    dummy = Sample.masked_dummy(
        _task(), reason=TerminationReason.INFRA_SANDBOX, agent_reason="max_turns"
    )
    assert dummy.tokens == (0, 0)
    assert dummy.loss_mask == (0, 0)
    assert dummy.response_length == 2
    assert dummy.rollout_log_probs == (0.0, 0.0)
    assert dummy.remove_sample
    assert dummy.reward == 0.0
    assert dummy.status is SampleStatus.ABORTED
    assert dummy.termination_reason is TerminationReason.INFRA_SANDBOX
    assert dummy.metadata["termination_reason_agent"] == "max_turns"
    assert (dummy.index, dummy.group_index, dummy.sample_id) == (7, 3, "r1:s7")


def test_masked_dummy_without_task() -> None:
    dummy = Sample.masked_dummy()
    assert (dummy.index, dummy.prompt, dummy.tokens) == (0, "", (0, 0))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"response_length": 5}, "exceeds"),
        ({"loss_mask": (1,)}, "loss_mask has 1 entries for 2"),
        ({"rollout_log_probs": (-1.0,)}, "logprobs have 1 entries"),
        ({"teacher_log_probs": (-1.0, -1.0, -1.0)}, "teacher_log_probs has 3"),
    ],
)
def test_sample_invariants(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {
        "index": 0,
        "group_index": 0,
        "tokens": (1, 2, 3),
        "response_length": 2,
        "loss_mask": (1, 1),
    }
    Sample.model_validate(base)
    with pytest.raises(ValidationError, match=message):
        Sample.model_validate({**base, **fields})


def test_token_arrays_stay_packed_from_the_agent_result_to_the_sample() -> None:
    result = _result()
    assert isinstance(result.response_token_ids, TokenIds)
    assert isinstance(result.loss_mask, Mask) and isinstance(result.response_logprobs, LogProbs)
    sample = Sample.from_agent_result(_task(), result, 1.0)
    assert isinstance(sample.tokens, TokenIds) and isinstance(sample.loss_mask, Mask)
    assert isinstance(sample.rollout_log_probs, LogProbs)
    assert sample.rollout_log_probs.data is result.response_logprobs.data  # no copy, no list
    assert sample.tokens.data == result.prompt_token_ids.data + result.response_token_ids.data


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"loss_mask": (1, 2)}, "0 or 1"), ({"response_token_ids": (20, -1)}, "non-negative"),
     ({"loss_mask": (1,)}, "1 entries for 2")],
)
def test_agent_result_still_refuses_bad_arrays(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _result(**overrides)
