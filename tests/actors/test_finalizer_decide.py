"""decide_ready / decide_capture / apply_filters: the finalizer's pure decisions."""

from __future__ import annotations

from typing import Any

from engine.actors.finalizer import apply_filters, decide_capture, decide_ready, worth_deciding
from engine.events import (
    AbortClass,
    Event,
    FilterSpec,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    TeacherScored,
    TokenIds,
)
from tests.rig import plan_events, rollout_state

RID = "r"


def _sid(i: int) -> str:
    return f"{RID}:s{i}"


def _plan(n_groups: int, per_group: int, **request: Any) -> list[Event]:
    return plan_events(
        n_groups,
        per_group,
        RolloutRequested(
            rollout_id=RID, n_prompts=n_groups, n_samples_per_prompt=per_group, **request
        ),
    )


def _done(i: int, reward: float, reason: str = "finish") -> SampleCompleted:
    return SampleCompleted(
        rollout_id=RID, sample_id=_sid(i), attempt=1,
        prompt_ids=TokenIds.from_values([1]), response_ids=TokenIds.from_values([2, 3]),
        logprobs=LogProbs.from_values([-1.0, -2.0]), loss_mask=Mask.from_values([1, 0]),
        reward=reward, termination_reason=reason,
    )


def _abort(i: int) -> SampleAborted:
    return SampleAborted(rollout_id=RID, sample_id=_sid(i), attempt=1,
                         abort_class=AbortClass.INFRA_CONN)


def test_not_ready_until_every_sample_is_terminal() -> None:
    events = [*_plan(1, 2), _done(0, 1.0)]
    assert decide_ready(rollout_state(events)) is None
    ready = decide_ready(rollout_state([*events, _abort(1)]))
    assert ready is not None
    assert ready.sample_ids == [_sid(0), _sid(1)]
    assert (ready.n_completed, ready.n_aborted, ready.dummy) == (1, 1, False)
    assert ready.policy_version == 0 and ready.metrics["n_samples"] == 2.0


def test_not_ready_before_the_plan_is_complete() -> None:
    events = [e for e in _plan(1, 1) if not isinstance(e, RolloutPlanned)] + [_done(0, 1.0)]
    assert decide_ready(rollout_state(events)) is None


def test_already_decided_is_not_decided_again() -> None:
    events = [*_plan(1, 1), _done(0, 1.0)]
    ready = decide_ready(rollout_state(events))
    assert ready is not None
    assert decide_ready(rollout_state([*events, ready])) is None


def test_rejection_drops_groups_with_equal_rewards() -> None:
    events = [
        *_plan(3, 2, filters=FilterSpec(reject_equal_rewards=True)),
        _done(0, 1.0), _done(1, 0.0),  # group 0: mixed -> kept
        _done(2, 1.0), _done(3, 1.0),  # group 1: all equal -> dropped
        _done(4, 0.0), _abort(5),  # group 2: one reward (the abort has none) -> dropped
    ]
    kept, dropped = apply_filters(rollout_state(events))
    assert kept == [_sid(0), _sid(1)]
    assert dropped == [_sid(2), _sid(3), _sid(4), _sid(5)]


def test_an_infra_aborted_sample_is_no_zero_reward_in_its_group() -> None:
    timeout = SampleAborted(rollout_id=RID, sample_id=_sid(3), attempt=1,
                            abort_class=AbortClass.AGENT_TIMEOUT)
    events = [
        *_plan(2, 2, filters=FilterSpec(reject_equal_rewards=True)),
        _done(0, 1.0), _abort(1),  # group 0: 1.0 and a server failure: one reward -> dropped
        _done(2, 1.0), timeout,  # group 1: 1.0 and the policy's own timeout (0) -> kept
    ]
    kept, dropped = apply_filters(rollout_state(events))
    assert kept == [_sid(2), _sid(3)] and dropped == [_sid(0), _sid(1)]


def test_finish_only_keeps_clean_finishes() -> None:
    events = [
        *_plan(1, 4, filters=FilterSpec(finish_only=True)),
        _done(0, 1.0), _done(1, 1.0, "max_turns"), _abort(2), _done(3, 0.0, "finish"),
    ]
    assert apply_filters(rollout_state(events))[0] == [_sid(0), _sid(3)]


def test_rejection_runs_before_finish_only() -> None:
    # Group 0 has rewards 1 (finish) and 0 (max_turns): mixed, so rejection keeps it; then
    # finish-only drops the truncated one. Run the other way round, the lone survivor
    # would form an all-equal group and rejection would drop it too.
    events = [
        *_plan(1, 2, filters=FilterSpec(reject_equal_rewards=True, finish_only=True)),
        _done(0, 1.0), _done(1, 0.0, "max_turns"),
    ]
    assert apply_filters(rollout_state(events)) == ([_sid(0)], [_sid(1)])


def test_an_emptied_rollout_is_one_dummy() -> None:
    events = [
        *_plan(1, 2, filters=FilterSpec(reject_equal_rewards=True)),
        _done(0, 1.0), _done(1, 1.0),
    ]
    ready = decide_ready(rollout_state(events))
    assert ready is not None and ready.dummy and ready.sample_ids == []
    assert ready.dropped_sample_ids == [_sid(0), _sid(1)]


def test_teacher_lane_waits_for_kept_samples_scores() -> None:
    events = [*_plan(1, 3, teacher_capture=True), _done(0, 1.0), _done(1, 0.0), _abort(2)]
    state = rollout_state(events)
    assert decide_ready(state) is None
    capture = decide_capture(state, top_k=5)
    assert capture is not None
    assert capture.sample_ids == [_sid(0), _sid(1)] and capture.top_k == 5  # not the abort
    scored = [
        TeacherScored(rollout_id=RID, sample_id=_sid(i), attempt=1,
                      teacher_logprobs=LogProbs.from_values([-0.5, -0.5]))
        for i in (0, 1)
    ]
    assert decide_ready(rollout_state([*events, scored[0]])) is None
    state = rollout_state([*events, *scored])
    assert decide_capture(state) is None
    ready = decide_ready(state)
    assert isinstance(ready, RolloutReady) and len(ready.sample_ids) == 3


def test_no_capture_without_teacher_capture() -> None:
    assert decide_capture(rollout_state([*_plan(1, 1), _done(0, 1.0)])) is None


def test_the_fold_counts_what_makes_a_decision_worth_computing() -> None:
    # The decision fold keeps the capture request and counts terminal and scored samples;
    # worth_deciding reads only those (the finalizer keeps no counters of its own).
    events = [*_plan(1, 3, teacher_capture=True), _done(0, 1.0), _done(1, 0.0)]
    state = rollout_state(events)
    assert (state.n_terminal, state.n_scored, state.capture) == (2, 0, None)
    assert not worth_deciding(state)
    events.append(_abort(2))
    events.append(_abort(2))  # a duplicate terminal counts once
    state = rollout_state(events)
    n_done = sum(b.done for b in state.samples.values())
    assert state.n_terminal == n_done == 3 and worth_deciding(state)
    capture = decide_capture(state)
    assert capture is not None
    events.append(capture)
    events.append(capture.model_copy(update={"sample_ids": [_sid(0)]}))  # the first wins
    state = rollout_state(events)
    assert state.capture == capture and not worth_deciding(state)  # waiting for 2 scores
    for i in (0, 1, 0):  # a repeated score counts once
        events.append(TeacherScored(rollout_id=RID, sample_id=_sid(i), attempt=1,
                                    teacher_logprobs=LogProbs.from_values([-0.5, -0.5])))
        state = rollout_state(events)
        assert worth_deciding(state) == (state.n_scored == 2)
    assert state.n_scored == 2 and decide_ready(state) is not None
