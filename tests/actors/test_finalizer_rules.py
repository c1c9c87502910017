"""The finalizer's decisions over the rollout fold, given events, then decisions out.

Each behaviour a trainer relies on is asserted on its own (selection of whole groups,
stale split, filters, the CE lane, teacher capture, tail aborts and carried tails, the
ready metrics and the version spread); ``test_finalizer_decide``, ``test_staleness_fold``
and the lane tests hold the rest. A property at the end drives the decisions on seeded
varied rollouts (filters, aborts, retries, duplicate terminals, stale tokens, tails,
carried samples, the per-token and CE lanes, stored prompts, joined tasks) after every
event and checks what every decision must satisfy.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.actors.finalizer import (
    carried_sources,
    decide_capture,
    decide_ready,
    select_groups,
    tail_aborts,
    tail_carried,
    worth_deciding,
)
from engine.events import (
    AbortClass,
    Event,
    FilterSpec,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TeacherScored,
    TokenIds,
    TurnCompleted,
)
from engine.events.catalog import PromptStored, TaskJoined
from engine.projections.decision import carries_tail, stale_split
from engine.projections.lanes import needs_teacher
from engine.projections.readback import Rollout
from engine.projections.rollout import RolloutState, staleness_floor
from tests.rig import plan_events, rollout_of, rollout_state

RID = "r"


def _sid(i: int) -> str:
    return f"{RID}:s{i}"


def _request(n_groups: int, **fields: Any) -> RolloutRequested:
    return RolloutRequested(rollout_id=RID, n_prompts=n_groups, **fields)


def _done(i: int, reward: float = 1.0, *, n: int = 2, versions: list[int] | None = None,
          teacher: list[int] | None = None, cuts: list[int] | None = None,
          reason: str = "finish", prompt_key: str = "") -> SampleCompleted:
    return SampleCompleted(
        rollout_id=RID, sample_id=_sid(i), attempt=1,
        prompt_ids=TokenIds.from_values([] if prompt_key else [1]), prompt_key=prompt_key,
        response_ids=TokenIds.from_values(list(range(n))),
        logprobs=LogProbs.from_values([-0.5] * n), loss_mask=Mask.from_values([1] * n),
        reward=reward, termination_reason=reason,
        token_versions=TokenIds.from_values(versions if versions is not None else []),
        teacher_mask=Mask.from_values(teacher or []), student_cut_points=cuts or [],
    )


def _abort(i: int, cls: AbortClass = AbortClass.INFRA_CONN) -> SampleAborted:
    return SampleAborted(rollout_id=RID, sample_id=_sid(i), attempt=1, abort_class=cls)


def _scored(i: int, n: int = 2) -> TeacherScored:
    return TeacherScored(rollout_id=RID, sample_id=_sid(i), attempt=1,
                         teacher_logprobs=LogProbs.from_values([-0.5] * n))


# ---------------------------------------------------------------- the ready metrics


def test_the_ready_event_counts_and_summarizes_the_chosen_samples() -> None:
    events = [*plan_events(2, 2, _request(2)),
              _done(0, 1.0, n=4), _done(1, 0.0, n=2, reason="max_turns"),
              _abort(2, AbortClass.AGENT_TIMEOUT), _done(3, 0.5, n=6)]
    ready = decide_ready(rollout_state(events))
    assert ready is not None and ready.sample_ids == [_sid(i) for i in range(4)]
    m = ready.metrics
    assert (m["n_samples"], m["n_kept"], m["n_dropped"], m["n_completed"], m["n_aborted"]) == (
        4.0, 4.0, 0.0, 3.0, 1.0)
    assert m["reward_mean"] == 1.5 / 4 and m["abort_rate"] == 0.25
    assert m["response_length_mean"] == 4.0  # completed samples only
    assert (m["class/success"], m["class/truncated_turns"], m["class/agent_timeout"]) == (
        2.0, 1.0, 1.0)
    assert m["class/wrong_answer"] == 0.0  # every one of the eight classes is listed
    assert "class/stale" not in m and "class/tail_aborted" not in m  # the engine's: if any
    assert m["rollout/d/accuracy"] == 0.5 and "eval/d/accuracy" not in m
    assert (ready.n_completed, ready.n_aborted, ready.iteration) == (3, 1, 0)


def test_an_eval_rollout_reports_eval_metrics() -> None:
    events = [*plan_events(1, 2, _request(1, kind="eval")), _done(0, 1.0), _done(1, 0.0)]
    ready = decide_ready(rollout_state(events))
    assert ready is not None and ready.kind.value == "eval"
    assert ready.metrics["eval/d/accuracy"] == 0.5 and ready.metrics["eval/d/pass@2"] == 1.0


def test_the_version_spread_counts_the_sampled_tokens_of_kept_trajectories() -> None:
    events = [*plan_events(2, 2, _request(2, filters=FilterSpec(reject_equal_rewards=True))),
              _done(0, 1.0, n=3, versions=[1, 2, 2]), _done(1, 0.0, n=1, versions=[3]),
              _done(2, 1.0, n=2, versions=[5, 5]), _done(3, 1.0, n=2)]  # group 1: dropped
    ready = decide_ready(rollout_state(events))
    assert ready is not None and ready.sample_ids == [_sid(0), _sid(1)]
    assert ready.version_tokens == {"1": 1, "2": 2, "3": 1}


# ---------------------------------------------------------------- selection and staleness


def test_a_rollout_is_chosen_whole_once_every_planned_sample_is_terminal() -> None:
    events = plan_events(2, 2, _request(2))
    state = rollout_state([*events, _done(0), _done(1), _done(3)])
    assert select_groups(state) is None and not worth_deciding(state)
    state = rollout_state([*events, _done(0), _done(1), _done(3), _abort(2)])
    selection = select_groups(state)
    assert selection is not None and selection.tail == []
    assert [r.sample_id for r in selection.samples] == [_sid(i) for i in range(4)]


def test_the_stale_split_excludes_old_and_unknown_versions_and_stale_aborts() -> None:
    events = [*plan_events(2, 2, _request(2, max_staleness=1)),
              _done(0, versions=[3, 3]), _done(1, versions=[1, 3]), _done(2),
              _abort(3, AbortClass.STALE)]
    state = rollout_state(events)
    floor = staleness_floor(state.request, 3)
    assert floor == 2
    fresh, stale, tokens = stale_split(state.ordered(), floor)
    assert [r.sample_id for r in fresh] == [_sid(0)]
    assert [r.sample_id for r in stale] == [_sid(1), _sid(2), _sid(3)]
    assert tokens == 4  # the sampled tokens of the stale trajectories
    ready = decide_ready(state, 3)
    assert ready is not None and ready.stale_sample_ids == [_sid(1), _sid(2), _sid(3)]
    assert (ready.trainer_version, ready.stale_tokens, ready.metrics["n_stale"]) == (3, 4, 3.0)


# ---------------------------------------------------------------- teacher capture


def test_capture_asks_for_the_fresh_kept_completed_samples_not_yet_scored() -> None:
    request = _request(3, algorithm="opd", max_staleness=0,
                       filters=FilterSpec(reject_equal_rewards=True))
    events = [*plan_events(3, 2, request),
              _done(0, 1.0, versions=[2, 2]), _done(1, 0.0, versions=[2, 2]),  # kept
              _done(2, 1.0, versions=[2, 2]),
              _abort(3, AbortClass.AGENT_TIMEOUT),  # kept: the agent's abort counts as 0
              _done(4, 1.0, versions=[1, 1]), _done(5, 0.0, versions=[2, 2]),  # 4 is stale
              _scored(1)]
    state = rollout_state(events)
    capture = decide_capture(state, top_k=7, trainer_version=2)
    assert capture is not None and capture.top_k == 7
    assert capture.sample_ids == [_sid(0), _sid(2)]  # not the abort, not the one scored
    assert decide_ready(state, 2) is None  # the kept trajectories wait for their scores
    state = rollout_state([*events, capture, _scored(0), _scored(2)])
    assert decide_capture(state, trainer_version=2) is None and worth_deciding(state)
    ready = decide_ready(state, 2)
    assert ready is not None and _sid(4) in ready.stale_sample_ids
    assert decide_capture(rollout_state([*events, ready]), trainer_version=2) is None


def test_a_sample_lost_to_the_infrastructure_leaves_its_group_statistics() -> None:
    request = _request(2, algorithm="opd", filters=FilterSpec(reject_equal_rewards=True))
    events = [*plan_events(2, 2, request),
              _done(0, 1.0), _done(1, 0.0),
              _done(2, 1.0), _abort(3)]  # its retries spent: no reward of the policy's
    capture = decide_capture(rollout_state(events), top_k=7)
    # The second group has one reward left, so its rewards are all equal: rejected.
    assert capture is not None and capture.sample_ids == [_sid(0), _sid(1)]


def test_the_ce_lane_is_never_captured() -> None:
    request = _request(1, algorithm="dagger_ce", teacher_capture=True)
    assert not needs_teacher(request)
    events = [*plan_events(1, 1, request), _done(0, teacher=[1, 1])]
    assert decide_capture(rollout_state(events)) is None
    assert decide_ready(rollout_state(events)) is not None


# ---------------------------------------------------------------- the CE lane


def test_the_ce_lane_drops_a_trajectory_with_an_over_long_sub_sample_whole() -> None:
    request = _request(2, algorithm="dagger_ce", knobs={"max_seq_len": 4})
    prompt = PromptStored(rollout_id=RID, prompt_key="k", prompt_ids=[7, 7, 7])
    events = [*plan_events(2, 2, request), prompt,
              _done(0, n=3, teacher=[1, 0, 1], cuts=[1]),  # chunks of 2 and 4 tokens
              _done(1, n=4, teacher=[1, 1, 1, 1]),  # one chunk of 5 tokens: too long
              _done(2, n=2, teacher=[0, 0]),  # no teacher token: no chunk
              _done(3, n=2, teacher=[1, 0], prompt_key="k")]  # 3 prompt tokens + 1: fits
    ready = decide_ready(rollout_state(events))
    assert ready is not None
    assert ready.sample_ids == [_sid(0), _sid(2), _sid(3)]
    assert ready.dropped_sample_ids == [_sid(1)]
    assert ready.gbs_scale == 1.5  # 3 sub-samples of 2 contributing trajectories
    assert (ready.metrics["ce/n_subsamples"], ready.metrics["ce/n_trajectories"],
            ready.metrics["ce/n_dropped_too_long"], ready.metrics["ce/gbs_scale"]) == (
        3.0, 2.0, 1.0, 1.5)
    longer = _done(3, n=2, teacher=[1, 1], prompt_key="k")  # 3 + 2 tokens: too long
    ready = decide_ready(rollout_state([*events[:-1], longer]))
    assert ready is not None and ready.dropped_sample_ids == [_sid(1), _sid(3)]


def test_other_lanes_keep_every_filtered_sample() -> None:
    request = _request(1, knobs={"max_seq_len": 1})
    ready = decide_ready(rollout_state([*plan_events(1, 1, request), _done(0, n=5)]))
    assert ready is not None and ready.gbs_scale == 1.0 and "ce/gbs_scale" not in ready.metrics


# ---------------------------------------------------------------- tails


def _partial(tail: str, stream: str | None = None) -> list[Event]:
    """Two groups planned, one needed: group 0 becomes whole first; of the tail, sample 2
    ended and sample 3 runs its attempt 2."""
    request = _request(1, overprovision=2.0, n_samples_per_prompt=2, tail=tail,
                       request_stream=stream)
    assert request.n_planned_prompts == 2
    return [
        *plan_events(2, 2, request),
        SampleStarted(rollout_id=RID, sample_id=_sid(3), attempt=2),
        TurnCompleted(rollout_id=RID, sample_id=_sid(3), attempt=2, turn=0),
        _done(2), _done(0), _done(1),
    ]


def test_an_aborted_tail_gets_its_aborts_with_attempt_and_turns() -> None:
    events = [*_partial("abort"), SampleStarted(rollout_id=RID, sample_id=_sid(3), attempt=2),
              TurnCompleted(rollout_id=RID, sample_id=_sid(3), attempt=2, turn=1)]
    state = rollout_state(events)
    ready = decide_ready(state)
    assert ready is not None and ready.tail_sample_ids == [_sid(2), _sid(3)]
    assert ready.metrics["n_tail"] == 2.0 and not ready.tail_carried
    (abort,) = tail_aborts(state, ready)  # the tail's sample 2 ended: no abort for it
    assert (abort.sample_id, abort.attempt, abort.turns) == (_sid(3), 2, 2)
    assert abort.abort_class is AbortClass.TAIL_ABORTED
    assert abort.error.startswith("tail of an over-provisioned rollout: it became ready with 2")
    assert not carries_tail(state, ready)
    assert tail_carried(state, ready, {}) is None


def test_a_carried_tail_is_handed_over_with_its_tasks() -> None:
    events = _partial("carry", "run")
    rollout: Rollout = rollout_of(events)
    state = rollout.state
    ready = decide_ready(state)
    assert ready is not None and ready.tail_carried and carries_tail(state, ready)
    assert tail_aborts(state, ready) == []  # the tail keeps running
    tasks = {sid: rollout.task(state.samples[sid]) for sid in ready.tail_sample_ids}
    carried = tail_carried(state, ready, tasks)
    assert carried is not None and carried.request_stream == "run"
    assert [t.sample_id for t in carried.tasks] == ready.tail_sample_ids
    assert all(isinstance(t, TaskFetched) for t in carried.tasks)


def test_carried_samples_are_grouped_by_the_rollout_they_run_in() -> None:
    request = _request(1)
    events: list[Event] = [request]
    for i, src in enumerate(["a", None, "b", "a"]):
        events.append(TaskFetched(rollout_id=RID, sample_id=_sid(i), index=i, group_index=0,
                                  prompt="p", dataset="d", task_type="t", carried_from=src))
    events.append(TaskJoined(rollout_id=RID, sample_id=_sid(4), index=4, group_index=0,
                             same_as=_sid(2)))
    assert carried_sources(rollout_state(events)) == {
        "a": {_sid(0), _sid(3)}, "b": {_sid(2), _sid(4)}}


# ---------------------------------------------------------------- on varied rollouts


REASONS = ["finish", "finish", "max_turns", "length", None]
ABORTS = [AbortClass.INFRA_CONN, AbortClass.AGENT_TIMEOUT, AbortClass.STALE,
          AbortClass.INFRA_SANDBOX]


def _varied(seed: int) -> list[Event]:
    """A seeded rollout's events, lifecycles interleaved across samples: any lane, filters,
    bounds, over-provisioning with either tail, stored prompts, joined and carried tasks,
    duplicate tasks and terminals, retries, teacher scorings of the right and wrong
    attempts, samples that never end."""
    rng = random.Random(seed)
    per = rng.randrange(1, 5)
    algorithm = rng.choice(["grpo", "grpo", "opd", "dagger_ce", "dagger_k3"])
    tail = rng.choice(["abort", "carry"])
    request = _request(
        rng.randrange(1, 4), n_samples_per_prompt=per, algorithm=algorithm,
        kind=rng.choice(["train", "train", "eval"]),
        knobs={"max_seq_len": rng.choice([6, 9, 14])} if algorithm == "dagger_ce" else {},
        filters=FilterSpec(reject_equal_rewards=rng.random() < 0.4,
                           finish_only=rng.random() < 0.3),
        teacher_capture=rng.random() < 0.2, max_staleness=rng.choice([None, None, 0, 1, 3]),
        overprovision=rng.choice([1.0, 1.0, 1.5, 2.0]), tail=tail,
        request_stream="run" if tail == "carry" else None,
    )
    head: list[Event] = [request]
    prompts = {g: f"p{g}" for g in range(request.n_planned_prompts) if rng.random() < 0.5}
    head += [PromptStored(rollout_id=RID, prompt_key=key, prompt_ids=[7] * (g + 1))
             for g, key in prompts.items()]
    n = request.n_planned_prompts * per
    for i in range(n):
        g = i // per
        task = TaskFetched(rollout_id=RID, sample_id=_sid(i), index=i, group_index=g,
                           prompt=f"q{g}", dataset=["math", "code"][g % 2], task_type="t",
                           carried_from="older" if g % 3 == 2 else None)
        joined = TaskJoined.of(task, head[-1]) if i % per and isinstance(
            head[-1], TaskFetched) else None
        head.append(joined if joined is not None and rng.random() < 0.7 else task)
        if rng.random() < 0.1:
            head.append(task)
    head.append(RolloutPlanned(rollout_id=RID, n_samples=n, n_batches=1))
    lives: list[list[Event]] = []
    for i in range(n):
        life: list[Event] = []
        last = rng.choice([0, 0, 1, 2])
        for attempt in range(last + 1):
            life.append(SampleStarted(rollout_id=RID, sample_id=_sid(i), attempt=attempt))
            life += [TurnCompleted(rollout_id=RID, sample_id=_sid(i), attempt=attempt, turn=t)
                     for t in range(rng.randrange(3))]
        fate = rng.random()
        if fate < 0.12:
            lives.append(life)
            continue
        if fate < 0.3:
            life.append(SampleAborted(rollout_id=RID, sample_id=_sid(i), attempt=last,
                                      abort_class=rng.choice(ABORTS), turns=rng.randrange(3)))
        else:
            k = rng.randrange(1, 9)
            done = SampleCompleted(
                rollout_id=RID, sample_id=_sid(i), attempt=rng.choice([last, max(0, last - 1)]),
                prompt_ids=[] if i // per in prompts else [1] * rng.randrange(1, 5),
                prompt_key=prompts.get(i // per, ""), response_ids=list(range(k)),
                logprobs=[-0.5] * k, loss_mask=[rng.choice([0, 1, 1]) for _ in range(k)],
                reward=rng.choice([0.0, 0.0, 1.0, 0.5, -1.0]),
                termination_reason=rng.choice(REASONS),
                token_versions=[rng.choice([-1, 0, 1, 3, 3, 4]) for _ in range(k)]
                if rng.random() < 0.8 else [],
                teacher_mask=[rng.choice([0, 1]) for _ in range(k)] if rng.random() < 0.6
                else [],
                student_cut_points=sorted(rng.sample(range(1, k + 2), min(k + 1, 2))),
            )
            life.append(done)
            if rng.random() < 0.6:
                life.append(TeacherScored(rollout_id=RID, sample_id=_sid(i),
                                          attempt=rng.choice([done.attempt] * 3 + [9]),
                                          teacher_logprobs=[-1.0] * k))
        if rng.random() < 0.15:
            life.append(SampleAborted(rollout_id=RID, sample_id=_sid(i), attempt=last + 1,
                                      abort_class=AbortClass.INFRA_OTHER))
        lives.append(life)
    body: list[Event] = []
    while any(lives):
        body.append(rng.choice([x for x in lives if x]).pop(0))
    return head + body


def _check(state: RolloutState, trainer: int | None) -> bool:
    """Every decision on ``state`` satisfies what the trainer relies on; True: ready."""
    request = state.request
    assert request is not None
    selection = select_groups(state)
    capture = decide_capture(state, top_k=3, trainer_version=trainer)
    ready = decide_ready(state, trainer)
    if ready is None:
        if capture is not None:  # capture asks for kept completed trajectories not scored
            assert selection is not None and needs_teacher(request)
            chosen = {r.sample_id for r in selection.samples}
            for sid in capture.sample_ids:
                r = state.samples[sid]
                assert sid in chosen and r.completed and not r.scored
        return False
    assert selection is not None and capture is None
    assert worth_deciding(state) or state.capture is None  # else the finalizer never decides
    chosen = [r.sample_id for r in selection.samples]
    kept, dropped, stale = ready.sample_ids, ready.dropped_sample_ids, ready.stale_sample_ids
    assert sorted(kept + dropped + stale) == sorted(chosen)  # each chosen sample once
    assert ready.tail_sample_ids == selection.tail
    assert set(chosen).isdisjoint(selection.tail)
    index = {sid: r.index for sid, r in state.samples.items()}
    for ids in (kept, dropped, stale, ready.tail_sample_ids):
        assert ids == sorted(ids, key=index.__getitem__)  # index (training) order
    assert ready.dummy == (not kept)
    assert all(state.samples[sid].done for sid in chosen)
    assert ready.n_completed + ready.n_aborted == len(chosen) == ready.metrics["n_samples"]
    if needs_teacher(request):
        assert all(state.samples[s].scored for s in kept if state.samples[s].completed)
    spread: Counter[int] = Counter()
    for sid in kept:
        if state.samples[sid].completed:
            spread.update(dict(state.samples[sid].versions))
    assert ready.version_tokens == {str(v): spread[v] for v in sorted(spread)}
    aborts = tail_aborts(state, ready)
    if ready.tail_carried:
        assert aborts == [] and carries_tail(state, ready)
    else:
        assert [a.sample_id for a in aborts] == [
            s for s in selection.tail if not state.samples[s].done]
    return True


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6))
def test_every_decision_on_varied_rollouts_keeps_its_promises(seed: int) -> None:
    events = _varied(seed)
    for at in range(1, len(events) + 1):
        state = rollout_state(events[:at])
        for trainer in (None, 0, 2, 5):
            _check(state, trainer)


def test_the_varied_rollouts_reach_every_kind_of_decision() -> None:
    """The rollouts of the property above decide often, in every lane, with tails of both
    kinds, stale samples, drops and captures (so the property checks them all)."""
    seen: Counter[str] = Counter()
    for seed in range(80):
        events = _varied(seed)
        request = events[0]
        assert isinstance(request, RolloutRequested)
        state = rollout_state(events)
        for trainer in (None, 5):
            ready = decide_ready(state, trainer)
            seen["capture"] += decide_capture(state, trainer_version=trainer) is not None
            if ready is None:
                continue
            seen["ready"] += 1
            seen[request.algorithm] += 1
            seen["stale"] += bool(ready.stale_sample_ids)
            seen["dropped"] += bool(ready.dropped_sample_ids)
            seen["carried" if ready.tail_carried else "aborted"] += bool(ready.tail_sample_ids)
    assert seen["ready"] > 40
    assert all(seen[k] for k in ("grpo", "opd", "dagger_ce", "dagger_k3", "stale", "dropped",
                                 "carried", "aborted", "capture")), seen
