"""Rollout projection: idempotence under redelivery, attempts, first terminal wins."""

from __future__ import annotations

import pytest

from engine.errors import RolloutError
from engine.events import (
    AbortClass,
    Envelope,
    Event,
    RolloutPlanned,
    RolloutReady,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.projections.base import fold, start
from engine.projections.rollout import RolloutProjection

R = "rl:{rollout:r}"


def envs(*events: Event) -> list[Envelope]:
    return [Envelope(R, f"{i + 1}-0", e) for i, e in enumerate(events)]


def task(i: int) -> TaskFetched:
    return TaskFetched(rollout_id="r", sample_id=f"s{i}", index=i, group_index=i // 2,
                       prompt="p", dataset="d", task_type="t")


def done(i: int, attempt: int = 0, reward: float = 1.0) -> SampleCompleted:
    return SampleCompleted(rollout_id="r", sample_id=f"s{i}", attempt=attempt, prompt_ids=[1],
                           response_ids=[2], logprobs=[-0.1], loss_mask=[1], reward=reward)


def test_duplicates_and_stale_attempts_are_ignored() -> None:
    p = RolloutProjection()
    events = envs(
        task(0), task(1), task(0),  # duplicate TaskFetched
        RolloutPlanned(rollout_id="r", n_samples=2, n_batches=1),
        SampleStarted(rollout_id="r", sample_id="s0", attempt=0),
        TurnCompleted(rollout_id="r", sample_id="s0", attempt=0, turn=0),
        SampleStarted(rollout_id="r", sample_id="s0", attempt=1),  # re-run after a crash
        TurnCompleted(rollout_id="r", sample_id="s0", attempt=0, turn=1),  # stale attempt
        TurnCompleted(rollout_id="r", sample_id="s0", attempt=1, turn=0),
        done(0, attempt=1, reward=0.5),
        done(0, attempt=0, reward=1.0),  # a late duplicate terminal loses
        SampleAborted(rollout_id="r", sample_id="s1", abort_class=AbortClass.INFRA_CONN),
        done(1),  # completion after the abort is ignored
        TeacherScored(rollout_id="r", sample_id="s0", attempt=0, teacher_logprobs=[-1.0]),
        TeacherScored(rollout_id="r", sample_id="s0", attempt=1, teacher_logprobs=[-2.0]),
        RolloutReady(rollout_id="r", sample_ids=["s0"]),
        RolloutReady(rollout_id="r", sample_ids=["s0", "s1"]),
    )
    state = fold(p, start(p), events).state
    assert state.n_samples == 2 and state.all_terminal()
    s0 = state.samples["s0"]
    assert s0.completed is not None and s0.completed.reward == 0.5 and s0.attempt == 1
    assert [t.turn for t in s0.turns] == [0]
    assert s0.teacher is not None and s0.teacher.teacher_logprobs.tolist() == [-2.0]
    assert state.samples["s1"].aborted is not None
    assert state.ready is not None and state.ready.sample_ids == ["s0"]


def test_redelivered_prefix_gives_the_same_state() -> None:
    p = RolloutProjection()
    events = envs(task(0), task(1), done(0), done(1))
    once = fold(p, start(p), events).state
    again = fold(p, fold(p, start(p), events[:3]), events).state
    assert once.samples == again.samples and once.pending() == again.pending() == []


def test_all_terminal_needs_the_complete_plan() -> None:
    p = RolloutProjection()
    state = fold(p, start(p), envs(task(0), done(0))).state
    assert not state.all_terminal()  # more tasks may still be coming
    planned = RolloutPlanned(rollout_id="r", n_samples=2, n_batches=1)
    state = fold(p, start(p), envs(task(0), done(0), planned)).state
    assert not state.all_terminal()  # a planned sample is missing
    state = fold(p, start(p), envs(task(0), task(1), planned, done(0), done(1))).state
    assert state.all_terminal()


def test_pending_lists_samples_without_terminal() -> None:
    p = RolloutProjection()
    state = fold(p, start(p), envs(task(0), task(1), task(2), done(1))).state
    assert state.pending() == ["s0", "s2"]
    assert state.pending(["s1", "s2", "zz"]) == ["s2"]
    assert [s.sample_id for s in state.ordered()] == ["s0", "s1", "s2"]


def test_a_joined_task_folds_as_its_groups_task_and_a_dangling_one_is_named() -> None:
    p = RolloutProjection()
    first = TaskFetched(rollout_id="r", sample_id="s0", index=0, group_index=0,
                        prompt=[{"role": "user", "content": "2+2?"}], label="4", dataset="d",
                        task_type="t", source_line=7, metadata={"k": 1},
                        stopping={"max_context_len": 64})
    joined = TaskJoined(rollout_id="r", sample_id="s1", index=1, group_index=0, same_as="s0")
    state = fold(p, start(p), envs(first, joined, joined)).state
    assert state.n_samples == 2 and state.group_size == {0: 2}
    assert state.samples["s1"].task == first.model_copy(
        update={"sample_id": "s1", "index": 1}
    )
    # The planner writes a sample joined only when nothing is lost: TaskJoined.of says so.
    assert TaskJoined.of(state.samples["s1"].task, first) == joined
    assert TaskJoined.of(first.model_copy(update={"sample_id": "s2", "label": "5"}), first) is None
    with pytest.raises(RolloutError, match="refers to sample 's9'"):
        fold(p, start(p), envs(first, joined.model_copy(update={"same_as": "s9"})))
