"""``Event.assemble``: the worker's per-sample events built from values of their field types
without a second validation are the events the constructor builds: equal, with the same
field order, the same ``model_fields_set`` and the same bytes on the wire."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import field_validator

from engine.actors.outcomes import Attempt, completed_events
from engine.agents.base import AgentResult, TurnRecord
from engine.domain import TerminationReason
from engine.events import Event, SampleCompleted, SampleStarted, TurnCompleted
from engine.events.codec import decode, encode

RESULTS = [
    AgentResult(
        prompt_token_ids=list(range(1, 90)),
        response_token_ids=(3, 4, 5, 70_000),
        response_logprobs=(-0.1, -0.2, -0.3, -0.4),
        loss_mask=(1, 1, 0, 0),
        response_versions=(2, 2, -1, -1),
        turns=(
            TurnRecord(index=0, prompt_tokens=2, response_tokens=2, tool_calls=("sh",),
                       elapsed_s=1, weight_version=2),
            TurnRecord(index=1, prompt_tokens=4, response_tokens=1),
        ),
        termination_reason=TerminationReason.MAX_TURNS,
        metrics={"m": 1, "n": 0.5},
        text="hi",
        teacher_mask=(0, 0, 1, 1),
        student_cut_points=(0, 2),
    ),
    AgentResult(response_token_ids=(1,), response_logprobs=(-1.0,), loss_mask=(1,),
                termination_reason=TerminationReason.FINISH),
]  # fmt: skip


def _constructed(event: Event) -> Event:
    """The same event through the validating constructor, given what ``assemble`` was."""
    return type(event)(**{name: event.__dict__[name] for name in event.model_fields_set})


def _assert_same(event: Event) -> None:
    reference = _constructed(event)
    assert event == reference
    assert list(event.__dict__) == list(reference.__dict__)
    assert event.model_fields_set == reference.model_fields_set
    assert encode(event, producer="w1") == encode(reference, producer="w1")
    assert decode(encode(event)) == reference


@pytest.mark.parametrize("result", RESULTS)
@pytest.mark.parametrize("reward", [1.0, {"acc": 1, "fmt": 0.5}])
@pytest.mark.parametrize("prompt_key", ["", "k1"])
def test_the_outcome_events_are_what_the_constructor_builds(
    result: AgentResult, reward: float | dict[str, float], prompt_key: str
) -> None:
    rec = Attempt(phase="eval", node="n1", gpu=None if prompt_key else 3, used_s=2.5)
    events = completed_events(
        rollout_id="r", sample_id="r:s0", attempt=2, rec=rec, result=result, reward=reward,
        policy_version=7, causation="c@1-0" if prompt_key else None, prompt_key=prompt_key,
    )  # fmt: skip
    assert [type(e) for e in events] == [TurnCompleted] * len(result.turns) + [SampleCompleted]
    for event in events:
        _assert_same(event)


def test_a_started_event_is_what_the_constructor_builds() -> None:
    _assert_same(SampleStarted.assemble(rollout_id="r", sample_id="s", attempt=1, batch_id="b",
                                        worker="w", node="", causation=None))  # fmt: skip


def test_missing_and_unknown_fields_are_named() -> None:
    with pytest.raises(TypeError, match="missing required field 'sample_id'"):
        SampleStarted.assemble(rollout_id="r")
    with pytest.raises(TypeError, match=r"unknown fields \['colour'\]"):
        SampleStarted.assemble(rollout_id="r", sample_id="s", colour="red")


def test_a_class_with_validators_is_refused() -> None:
    class Checked(Event):
        type: Literal["TestAssembleChecked"] = "TestAssembleChecked"
        n: int

        @field_validator("n")
        @classmethod
        def _positive(cls, n: int) -> int:
            if n < 1:
                raise ValueError("n must be positive")
            return n

    with pytest.raises(TypeError, match="has validators"):
        Checked.assemble(n=0)
