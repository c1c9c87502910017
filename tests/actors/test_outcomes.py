"""An attempt's outcome events: pure functions of the attempt record, the agent's result
and the exception that ended it (no Redis, no agent)."""

from __future__ import annotations

import pytest

from engine.actors.outcomes import (
    Attempt,
    ReportedAbort,
    aborted_event,
    completed_events,
)
from engine.agents.base import AgentResult, Reward, TurnRecord
from engine.domain import TerminationReason
from engine.errors import AgentError, BackendUnavailable
from engine.events import AbortClass, Event, SampleAborted, SampleCompleted, TurnCompleted
from engine.events.codec import decode, encode
from engine.events.fastpath import field_layout
from engine.projections.rows import sample_row

RESULT = AgentResult(
    prompt_token_ids=(1, 2),
    response_token_ids=(3, 4, 5),
    response_logprobs=(-0.1, -0.2, -0.3),
    loss_mask=(1, 1, 0),
    turns=(TurnRecord(index=0, prompt_tokens=2, response_tokens=2, tool_calls=("sh",)),
           TurnRecord(index=1, prompt_tokens=4, response_tokens=1)),
    termination_reason=TerminationReason.MAX_TURNS,
    metrics={"m": 1.0},
    text="hi",
)


def test_a_completed_attempt_is_its_turns_then_the_sample() -> None:
    rec = Attempt(phase="eval", node="n1", gpu=1, used_s=2.5)
    events = completed_events(rollout_id="r", sample_id="r:s0", attempt=2, rec=rec,
                              result=RESULT, reward={"acc": 1.0, "fmt": 0.5},
                              policy_version=7, causation="c@1-0")
    *turns, done = events
    assert [t.turn for t in turns if isinstance(t, TurnCompleted)] == [0, 1]
    assert all(isinstance(t, TurnCompleted) and t.node == "n1" and t.gpu == 1 and
               t.attempt == 2 for t in turns)
    assert isinstance(done, SampleCompleted)
    assert done.response_ids.tolist() == [3, 4, 5] and done.loss_mask.tolist() == [1, 1, 0]
    assert done.reward_detail == {"acc": 1.0, "fmt": 0.5}
    assert done.termination_reason == "max_turns" and done.n_turns == 2
    assert done.elapsed_s == 2.5 and done.policy_version == 7 and done.causation == "c@1-0"
    plain = completed_events(rollout_id="r", sample_id="r:s0", attempt=1, rec=rec,
                             result=RESULT, reward=0.25, policy_version=0, causation=None)
    assert isinstance(plain[-1], SampleCompleted) and plain[-1].reward == 0.25


@pytest.mark.parametrize("reward", [None, True, "1.0"])
def test_a_reward_that_is_not_a_number_is_refused(reward: object) -> None:
    with pytest.raises(AgentError, match="eval must return a float or a dict of floats"):
        completed_events(rollout_id="r", sample_id="r:s0", attempt=1, rec=Attempt(),
                         result=RESULT, reward=reward, policy_version=0,  # type: ignore[arg-type]
                         causation=None)


def test_an_abort_is_classified_and_carries_the_attempts_diagnostics() -> None:
    rec = Attempt(phase="run", node="n2", turns=3, used_s=1.5, window_s=10.0)
    try:
        raise AgentError("model call failed") from BackendUnavailable("refused")
    except AgentError as exc:
        ev = aborted_event(rollout_id="r", sample_id="r:s1", attempt=1, rec=rec, exc=exc,
                           causation="c")
    assert ev.abort_class is AbortClass.INFRA_CONN
    assert ev.error.startswith("AgentError: model call failed (caused by BackendUnavailable")
    assert (ev.phase, ev.node, ev.turns, ev.elapsed_s, ev.window_s) == ("run", "n2", 3, 1.5, 10.0)


def test_an_abort_the_agent_reported_keeps_its_reason() -> None:
    ev = aborted_event(rollout_id="r", sample_id="r:s1", attempt=1, rec=Attempt(phase="run"),
                       exc=ReportedAbort(TerminationReason.AGENT_TIMEOUT), causation=None)
    assert ev.abort_class is AbortClass.AGENT_TIMEOUT
    assert ev.error == "the agent ended the episode with agent_timeout"


def test_the_progress_report_of_each_terminal() -> None:
    done = completed_events(rollout_id="r", sample_id="r:s0", attempt=2, rec=Attempt(),
                            result=RESULT, reward=1.0, policy_version=0, causation=None)[-1]
    assert isinstance(done, SampleCompleted)
    ok = sample_row(None, done, batch_id="b", attempt=2)
    assert (ok.completed, ok.reward, ok.termination_reason, ok.phase, ok.batch_id) == (
        True, 1.0, "max_turns", "", "b")
    abort = SampleAborted(rollout_id="r", sample_id="r:s1", attempt=1,
                          abort_class=AbortClass.INFRA_SANDBOX, error="x", phase="init",
                          elapsed_s=0.5)
    bad = sample_row(None, abort, batch_id="b", attempt=1)
    assert (bad.completed, bad.reward, bad.abort_class, bad.phase, bad.elapsed_s) == (
        False, 0.0, "infra_sandbox", "init", 0.5)


def _validated(event: Event) -> Event:
    """The same event built the validating way, from the fields it was given."""
    passed = {name: getattr(event, name) for name in event.model_fields_set}
    return type(event)(**passed)


@pytest.mark.parametrize(
    ("result", "reward", "rec", "causation", "prompt_key"),
    [
        (RESULT, {"acc": 1, "fmt": 0.5}, Attempt(node="n1", gpu=1, used_s=2), "c@1-0", ""),
        (RESULT, 1, Attempt(), None, "k" * 24),
        (
            AgentResult(
                prompt_token_ids=[7], response_token_ids=[8, 9, 10], response_logprobs=[0, -1, -2],
                loss_mask=[1, 0, 0], teacher_mask=[0, 1, 1], student_cut_points=[0],
                response_versions=[3, -1, -1], metrics={"m": 2}, text="t",
                turns=(TurnRecord(index=0, prompt_tokens=1, response_tokens=1, elapsed_s=1,
                                  weight_version=3, tool_calls=("a", "b")),),
                termination_reason=TerminationReason.LENGTH,
            ),
            0.25, Attempt(node="", gpu=None, used_s=0.5), None, "",
        ),
    ],
)
def test_outcome_events_equal_their_validated_construction(
    result: AgentResult, reward: Reward, rec: Attempt, causation: str | None, prompt_key: str
) -> None:
    events = completed_events(rollout_id="r", sample_id="r:s0", attempt=2, rec=rec,
                              result=result, reward=reward, policy_version=3,
                              causation=causation, prompt_key=prompt_key)
    for event in events:
        reference = _validated(event)
        assert event == reference
        assert list(event.__dict__) == list(reference.__dict__)  # field order: the wire's
        assert {k: type(v) for k, v in event.__dict__.items()} == {
            k: type(v) for k, v in reference.__dict__.items()
        }
        assert event.model_fields_set == reference.model_fields_set
        assert encode(event) == encode(reference)
        assert decode(encode(event)) == event


def test_a_trusted_builder_refuses_a_stale_field_list() -> None:
    with pytest.raises(TypeError, match="TurnCompleted: a trusted builder lists the fields"):
        field_layout(TurnCompleted, ("type", "producer", "causation", "rollout_id"))
