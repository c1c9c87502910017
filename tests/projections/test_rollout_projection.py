"""The rollout fold's rules, given events and then the record they fold to.

Each rule of ``engine.projections.rollout`` is written once; each is held here by events in
and a record (or a raised error) out. Properties at the end hold the fold to what
at-least-once delivery needs: a redelivered copy of an event, the interleaving of the
samples' lifecycles and a re-read prefix change nothing the fold decides.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import RolloutError
from engine.events import (
    AbortClass,
    BatchSealed,
    Envelope,
    Event,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.events.catalog import CaptureRequested, PromptStored, RolloutFailed
from engine.events.codec import decode, encode
from engine.events.fastpath import checked
from engine.outcomes import FailureClass, SampleStatus, TerminationReason
from engine.projections.base import fold, start
from engine.projections.rollout import (
    MARK_EVERY,
    RolloutProjection,
    RolloutState,
    SampleRecord,
)

R = "rl:{rollout:r}"


def envs(*events: Event) -> list[Envelope]:
    return [Envelope(R, f"{i + 1}-0", e) for i, e in enumerate(events)]


def folded(*events: Event) -> RolloutState:
    p = RolloutProjection()
    return fold(p, start(p), envs(*events)).state


def task(i: int, group: int | None = None, **fields: object) -> TaskFetched:
    values: dict[str, object] = {"prompt": "p", "dataset": "d", "task_type": "t", **fields}
    return TaskFetched(rollout_id="r", sample_id=f"s{i}", index=i,
                       group_index=i // 2 if group is None else group,
                       **values)  # type: ignore[arg-type]


def started(i: int, attempt: int, worker: str = "w") -> SampleStarted:
    return SampleStarted(rollout_id="r", sample_id=f"s{i}", attempt=attempt, worker=worker,
                         node=f"n-{worker}", batch_id="b")


def turn(i: int, attempt: int, n: int = 0) -> TurnCompleted:
    return TurnCompleted(rollout_id="r", sample_id=f"s{i}", attempt=attempt, turn=n)


def done(i: int, attempt: int = 0, reward: float = 1.0, **fields: object) -> SampleCompleted:
    values: dict[str, object] = {
        "prompt_ids": [1], "response_ids": [2, 3], "logprobs": [-0.1, -0.2],
        "loss_mask": [1, 1], "reward": reward, "termination_reason": "finish",
    }
    values.update(fields)
    return SampleCompleted(rollout_id="r", sample_id=f"s{i}", attempt=attempt,
                           **values)  # type: ignore[arg-type]


def abort(i: int, attempt: int = 0, cls: AbortClass = AbortClass.INFRA_CONN,
          turns: int = 0) -> SampleAborted:
    return SampleAborted(rollout_id="r", sample_id=f"s{i}", attempt=attempt, abort_class=cls,
                         turns=turns)


def scored(i: int, attempt: int) -> TeacherScored:
    return TeacherScored(rollout_id="r", sample_id=f"s{i}", attempt=attempt,
                         teacher_logprobs=[-1.0, -1.0])


# ---------------------------------------------------------------- tasks


def test_the_first_task_of_a_sample_id_wins() -> None:
    state = folded(task(0, label="first"), task(0, label="second"), task(1))
    assert state.n_samples == 2 and state.group_size == {0: 2}
    assert state.samples["s0"].task_at == "1-0"  # the entry samples are built from


def test_a_joined_task_takes_its_groups_fields_and_its_first_task_as_root() -> None:
    first = task(0, dataset="math", carried_from="older")
    joined = TaskJoined(rollout_id="r", sample_id="s1", index=1, group_index=0, same_as="s0")
    chained = TaskJoined(rollout_id="r", sample_id="s2", index=2, group_index=0, same_as="s1")
    state = folded(first, joined, joined, chained)
    s1, s2 = state.samples["s1"], state.samples["s2"]
    assert (s1.dataset, s1.carried_from, s1.task_at, s1.root_at) == ("math", "older", "2-0", "1-0")
    assert (s2.task_at, s2.root_at) == ("4-0", "1-0")  # a chain leads back to the whole task
    assert state.carried == {"older": {"s0", "s1", "s2"}}
    assert state.group_size == {0: 3}


def test_a_joined_task_whose_first_no_earlier_entry_holds_is_named() -> None:
    joined = TaskJoined(rollout_id="r", sample_id="s1", index=1, group_index=0, same_as="s9")
    with pytest.raises(RolloutError, match="refers to sample 's9'"):
        folded(task(0), joined)


# ---------------------------------------------------------------- attempts and turns


def test_a_start_never_lowers_the_attempt_and_a_higher_one_starts_its_turns_afresh() -> None:
    state = folded(
        task(0),
        started(0, 0, "w1"), turn(0, 0, 0), turn(0, 0, 1),
        started(0, 2, "w2"), turn(0, 2, 0),  # a re-run after a crash
        started(0, 1, "w3"), turn(0, 1, 5),  # a stale holder: ignored
        started(0, 2, "w4"),  # the same attempt again: its turns stay
    )
    r = state.samples["s0"]
    assert (r.attempt, r.turns, r.turn_at) == (2, 1, ("6-0",))
    assert (r.worker, r.node, r.batch_id) == ("w4", "n-w4", "b") and r.started


def test_a_sample_never_started_has_no_worker() -> None:
    r = folded(task(0)).samples["s0"]
    assert not r.started and r.attempt == -1 and r.turns == 0


def test_turns_count_for_the_current_attempt_only() -> None:
    state = folded(task(0), started(0, 1), turn(0, 0), turn(0, 2), turn(0, 1), turn(0, 1, 1))
    assert state.samples["s0"].turns == 2


# ---------------------------------------------------------------- terminals


def test_the_first_terminal_wins_whatever_its_attempt() -> None:
    state = folded(
        task(0), task(1),
        started(0, 1), turn(0, 1),
        done(0, attempt=1, reward=0.5),
        done(0, attempt=2, reward=1.0),  # a later attempt's terminal: too late
        abort(1, attempt=0),
        done(1, attempt=3),  # a completion after the abort: ignored
    )
    s0, s1 = state.samples["s0"], state.samples["s1"]
    assert s0.completed and s0.reward == 0.5 and s0.terminal_at == "5-0"
    assert (s0.attempt, s0.terminal_attempt, s0.turns) == (1, 1, 1)
    assert s1.aborted and s1.terminal_at == "7-0" and s1.reward == 0.0
    assert state.n_terminal == 2


def test_a_terminal_of_another_attempt_records_none_of_the_current_turns() -> None:
    state = folded(task(0), task(1), started(0, 2), turn(0, 2), turn(0, 2, 1), done(0, 1),
                   started(1, 0), turn(1, 0), done(1, 3))
    s0, s1 = state.samples["s0"], state.samples["s1"]
    assert (s0.attempt, s0.terminal_attempt, s0.turns, s0.turn_at) == (2, 1, 0, ())
    assert (s1.attempt, s1.terminal_attempt, s1.turns) == (3, 3, 0)


def test_a_terminal_of_an_unknown_sample_changes_nothing() -> None:
    state = folded(task(0), done(7), abort(8))
    assert state.n_terminal == 0 and list(state.samples) == ["s0"]


def test_a_completion_records_its_outcome() -> None:
    state = folded(task(0), task(1), started(0, 0), turn(0, 0),
                   done(0, reward=0.0, termination_reason="max_turns", n_turns=4,
                        loss_mask=[1, 0], token_versions=[3, 3]),
                   started(1, 0), turn(1, 0), done(1, reward=0.0, n_turns=0))
    s0, s1 = state.samples["s0"], state.samples["s1"]
    assert s0.status is SampleStatus.COMPLETED and s0.reason is TerminationReason.MAX_TURNS
    assert s0.failure_class is FailureClass.TRUNCATED_TURNS and not s0.finished
    assert (s0.turns, s0.response_length, s0.versions) == (4, 2, ((3, 1),))
    assert s1.turns == 1  # no n_turns: the turns recorded
    assert s1.finished and s1.failure_class is FailureClass.WRONG_ANSWER


def test_an_abort_records_its_class_and_turns() -> None:
    r = folded(task(0), started(0, 1), turn(0, 1),
               abort(0, 1, AbortClass.AGENT_TIMEOUT, turns=3)).samples["s0"]
    assert r.aborted and not r.completed and r.abort_class is AbortClass.AGENT_TIMEOUT
    assert r.reason is TerminationReason.AGENT_TIMEOUT
    assert r.failure_class is FailureClass.AGENT_TIMEOUT and r.turns == 3
    assert r.turn_at == ("3-0",)  # the attempt's turns, for the placement log


def test_tokens_per_weight_version_are_counted_over_sampled_tokens() -> None:
    state = folded(task(0), task(1), task(2),
                   done(0, loss_mask=[1, 0, 1, 1], token_versions=[2, 9, 1, 2],
                        response_ids=[1, 2, 3, 4], logprobs=[0.0] * 4),
                   done(1, loss_mask=[1, 1]),  # no versions recorded: unknown
                   done(2, loss_mask=[0, 0], token_versions=[5, 5]))
    assert state.samples["s0"].versions == ((1, 1), (2, 2))
    assert (state.samples["s0"].low_version, state.samples["s0"].n_sampled) == (1, 3)
    assert state.samples["s1"].versions == ((-1, 2),)
    assert state.samples["s2"].versions == ()


# ---------------------------------------------------------------- teacher and prompts


def test_a_teacher_scoring_counts_for_the_terminal_attempt_once() -> None:
    state = folded(task(0), task(1), started(0, 2), done(0, 1), abort(1),
                   scored(0, 2), scored(0, 1), scored(0, 1), scored(1, 0))
    assert state.samples["s0"].teacher_at == "7-0" and state.samples["s0"].scored
    assert not state.samples["s1"].scored  # an abort has no trajectory to score
    assert state.n_scored == 1


def test_a_scoring_before_the_terminal_does_not_count() -> None:
    state = folded(task(0), scored(0, 0), done(0, 0))
    assert not state.samples["s0"].scored and state.n_scored == 0


def test_a_trajectory_refers_to_the_first_prompt_stored_under_its_key() -> None:
    first = PromptStored(rollout_id="r", prompt_key="k", prompt_ids=[7, 7, 7])
    again = PromptStored(rollout_id="r", prompt_key="k", prompt_ids=[8])
    state = folded(first, again, task(0), done(0, prompt_ids=[], prompt_key="k"))
    assert state.prompts == {"k": ("1-0", 3)}
    assert state.samples["s0"].prompt_at == "1-0"


def test_a_prompt_no_earlier_entry_stores_is_named() -> None:
    with pytest.raises(RolloutError, match="'missing'"):
        folded(task(0), done(0, prompt_ids=[], prompt_key="missing"))


def test_the_ce_lane_records_sub_samples_counting_a_stored_prompt() -> None:
    request = RolloutRequested(rollout_id="r", n_prompts=1, algorithm="dagger_ce")
    prompt = PromptStored(rollout_id="r", prompt_key="k", prompt_ids=[7] * 5)
    traj = done(0, prompt_ids=[], prompt_key="k", teacher_mask=[1, 1],
                student_cut_points=[1])
    r = folded(request, prompt, task(0), traj).samples["s0"]
    assert r.ce is not None and [(c.start, c.end, c.n_tokens) for c in r.ce] == [
        (0, 1, 6), (1, 2, 7)]
    plain = folded(RolloutRequested(rollout_id="r", n_prompts=1), task(0), traj.model_copy(
        update={"prompt_key": "", "prompt_ids": [1]}))
    assert plain.samples["s0"].ce is None  # another lane keeps none


# ---------------------------------------------------------------- the rollout's events


def test_the_first_request_plan_capture_ready_and_failure_win() -> None:
    events: list[Event] = []
    for n in (1, 2):
        events += [
            RolloutRequested(rollout_id="r", n_prompts=n),
            RolloutPlanned(rollout_id="r", n_samples=n, n_batches=1),
            CaptureRequested(rollout_id="r", sample_ids=[f"s{n}"]),
            RolloutReady(rollout_id="r", sample_ids=[f"s{n}"]),
            RolloutFailed(rollout_id="r", reason=f"r{n}"),
            BatchSealed(rollout_id="r", batch_id="b", seq=n, evaluator_id="e",
                        sample_ids=[f"s{n}"]),
        ]
    state = folded(*events)
    assert state.request is not None and state.request.n_prompts == 1
    assert state.planned is not None and state.planned.n_samples == 1
    assert state.capture is not None and state.capture.sample_ids == ["s1"]
    assert state.ready is not None and state.ready.sample_ids == ["s1"]
    assert state.failed is not None and state.failed.reason == "r1"
    assert state.batches["b"].seq == 1 and state.decided


def test_groups_become_whole_in_log_order() -> None:
    state = folded(task(0, 0), task(1, 0), task(2, 1), task(3, 1), task(4, 2),
                   done(2), done(0), done(4), done(3), done(1), done(1))
    assert state.completed_groups == [2, 1, 0]
    assert state.group_done == {0: 2, 1: 2, 2: 1}


def test_all_terminal_needs_the_complete_plan() -> None:
    planned = RolloutPlanned(rollout_id="r", n_samples=2, n_batches=1)
    assert not folded(task(0), done(0)).all_terminal()  # more tasks may still be coming
    assert not folded(task(0), done(0), planned).all_terminal()  # a planned sample missing
    state = folded(task(0), task(1), planned, done(0), done(1))
    assert state.all_terminal()
    assert folded(task(0), task(1), task(2), done(1)).pending(["s1", "s2", "zz"]) == ["s2"]


def test_every_mark_th_entry_is_marked() -> None:
    state = folded(*[task(i) for i in range(2 * MARK_EVERY + 1)])
    assert state.n_entries == 2 * MARK_EVERY + 1
    assert state.marks == [(1, 0), (MARK_EVERY + 1, 0), (2 * MARK_EVERY + 1, 0)]


# ---------------------------------------------------------------- properties


def _rollout(seed: int) -> list[Event]:
    """A seeded rollout: tasks (some joined), a plan, and per sample a life of starts,
    turns, a terminal (of some attempt), a teacher scoring (of some attempt), interleaved."""
    rng = random.Random(seed)
    n = rng.randrange(1, 7)
    head: list[Event] = [RolloutRequested(rollout_id="r", n_prompts=n)]
    for i in range(n):
        if i % 2 and rng.random() < 0.5:
            head.append(TaskJoined(rollout_id="r", sample_id=f"s{i}", index=i,
                                   group_index=i // 2, same_as=f"s{i - 1}"))
        else:
            head.append(task(i))
    head.append(RolloutPlanned(rollout_id="r", n_samples=n, n_batches=1))
    lives: list[list[Event]] = []
    for i in range(n):
        life: list[Event] = []
        for attempt in range(rng.randrange(1, 4)):
            life.append(started(i, attempt, rng.choice(["w1", "w2"])))
            life += [turn(i, attempt, t) for t in range(rng.randrange(3))]
        last = attempt
        fate = rng.random()
        if fate < 0.3:
            life.append(abort(i, rng.choice([last, last - 1, last + 1])))
        elif fate < 0.9:
            life.append(done(i, rng.choice([last, max(0, last - 1)]), rng.choice([0.0, 1.0])))
            life.append(scored(i, rng.choice([last, last - 1])))
        lives.append(life)
    body: list[Event] = []
    while any(lives):
        life = rng.choice([x for x in lives if x])
        body.append(life.pop(0))
    return head + body


def _decided(state: RolloutState) -> tuple[object, ...]:
    """What the fold decides, without where each entry is."""
    return (
        {sid: _outcome(r) for sid, r in state.samples.items()},
        state.n_terminal, state.n_scored, state.group_size, state.request, state.planned,
    )


def _outcome(r: SampleRecord) -> tuple[object, ...]:
    return (r.index, r.group_index, r.dataset, r.attempt, r.turns, r.status, r.reason,
            r.abort_class, r.failure_class, r.terminal_attempt, r.reward, r.response_length,
            r.versions, r.scored, r.worker)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_a_redelivered_copy_changes_nothing_the_fold_records(seed: int, where: int) -> None:
    """A copy of one event (not a turn: turns are counted as they come) written again
    later: the same records, built from the same (first) entries."""
    events = _rollout(seed)
    rng = random.Random(where)
    at = rng.choice([i for i, e in enumerate(events) if not isinstance(e, TurnCompleted)])
    later = rng.randrange(at + 1, len(events) + 1)
    once = folded(*events)
    again = folded(*events[:later], events[at], *events[later:])
    assert _decided(again) == _decided(once)

    def index(entry: str | None, copied: bool) -> int | None:  # its index in ``events``
        if entry is None:
            return None
        k = int(entry.split("-")[0]) - 1
        if not copied:
            return k
        assert k != later, "the copy was recorded"
        return k if k < later else k - 1

    for sid, r in once.samples.items():
        a = again.samples[sid]
        for name in ("task_at", "root_at", "terminal_at", "teacher_at"):
            assert index(getattr(a, name), True) == index(getattr(r, name), False), name


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_the_interleaving_of_the_samples_changes_no_sample(seed: int, shuffle: int) -> None:
    events = _rollout(seed)
    head = [e for e in events if not hasattr(e, "attempt")]
    lives: dict[str, list[Event]] = {}
    for e in events:
        if hasattr(e, "attempt"):
            lives.setdefault(e.sample_id, []).append(e)  # type: ignore[attr-defined]
    rng = random.Random(shuffle)
    body: list[Event] = []
    while any(lives.values()):
        body.append(lives[rng.choice([k for k, v in lives.items() if v])].pop(0))
    a, b = folded(*events), folded(*head, *body)
    assert {k: _outcome(r) for k, r in a.samples.items()} == {
        k: _outcome(r) for k, r in b.samples.items()}


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 10**3))
def test_a_re_read_prefix_gives_the_same_state(seed: int, cut: int) -> None:
    p = RolloutProjection()
    events = envs(*_rollout(seed))
    once = fold(p, start(p), events).state
    prefix = events[: cut % (len(events) + 1)]
    again = fold(p, fold(p, start(p), prefix), events).state
    assert again == once


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["grpo", "dagger_ce"]))
def test_folding_checked_fields_gives_the_state_folding_events_gives(
    seed: int, algorithm: str
) -> None:
    """The finalizer folds a stream's lifecycle entries from their checked fields
    (``fastpath.checked``), not their events: the same handlers, so the same state."""
    events = _rollout(seed)
    events[0] = RolloutRequested(rollout_id="r", n_prompts=1, algorithm=algorithm)
    p = RolloutProjection()
    state, n_fields = p.initial(), 0
    for i, e in enumerate(events):
        at, raw = f"{i + 1}-0", encode(e)
        fields = checked(raw)
        if fields is not None and p.fold_checked(state, at, *fields):
            n_fields += 1
        else:
            p.evolve(state, Envelope(R, at, decode(raw)))
    assert state == folded(*events)
    lifecycle = (TaskJoined, SampleStarted, TurnCompleted, SampleCompleted, SampleAborted,
                 TeacherScored)
    assert n_fields == sum(isinstance(e, lifecycle) for e in events)
