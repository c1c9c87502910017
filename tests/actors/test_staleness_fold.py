"""The staleness bound and partial-rollout selection as pure decisions of the folded log.

Issue 12, points 4 and 6: which samples a ``RolloutReady`` keeps, which the bound excluded and
which groups an over-provisioned rollout is made of are functions of the rollout stream and
the trainer's version recorded in the ``RolloutReady`` only -- re-deciding from the replayed
stream gives the same event, and the artifacts are byte-identical.
"""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.actors.finalizer import (
    decide_ready,
    select_groups,
    stale_split,
    tail_aborts,
    worth_deciding,
)
from engine.actors.planning import admission_refused, check_partial
from engine.errors import ConfigError
from engine.events import (
    AbortClass,
    Envelope,
    LogProbs,
    Mask,
    PolicyVersionPublished,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    TokenIds,
)
from engine.events.codec import decode, encode
from engine.ops.replay import replay_state
from engine.projections.control import ControlProjection
from engine.projections.rollout import staleness_floor, version_meets
from engine.projections.rows import sample_rows
from engine.projections.summary import build_summary, render_artifacts
from tests.rig import control_with, envelopes, plan_events, rollout_of, rollout_state

RID = "r"


def _sid(i: int) -> str:
    return f"{RID}:s{i}"


def _done(i: int, versions: list[int], *, observation_at: int | None = None) -> SampleCompleted:
    """A completed sample whose response tokens came from ``versions`` (one per token); the
    token at ``observation_at`` is an observation (mask 0, version -1)."""
    n = len(versions)
    mask = [1] * n
    tv = list(versions)
    if observation_at is not None and n:
        mask[observation_at % n] = 0
        tv[observation_at % n] = -1
    return SampleCompleted(
        rollout_id=RID, sample_id=_sid(i), attempt=1,
        prompt_ids=TokenIds.from_values([1]), response_ids=TokenIds.from_values([7] * n),
        logprobs=LogProbs.from_values([-0.5] * n), loss_mask=Mask.from_values(mask),
        reward=float(i % 2), termination_reason="finish",
        token_versions=TokenIds.from_values(tv),
    )


def _request(**kw: object) -> RolloutRequested:
    base: dict[str, object] = {"rollout_id": RID, "n_prompts": 2, "n_samples_per_prompt": 2}
    base.update(kw)
    return RolloutRequested.model_validate(base)


# ---------------------------------------------------------------- the bound


def test_floor_is_current_minus_staleness_and_unknown_never_meets() -> None:
    req = _request(max_staleness=2, policy_version=3)
    assert staleness_floor(req, None) == 1  # nothing published: the request's version
    assert staleness_floor(req, 7) == 5
    assert staleness_floor(req, 1) == 1  # the request's version when it is higher
    assert staleness_floor(_request(), 9) is None
    assert version_meets(5, 5) and not version_meets(4, 5)
    assert not version_meets(-1, -3)  # unknown: even under a negative floor
    assert version_meets(-1, None)


versions_st = st.lists(st.integers(min_value=-1, max_value=6), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    samples=st.lists(versions_st, min_size=4, max_size=4),
    observation=st.lists(st.integers(0, 5) | st.none(), min_size=4, max_size=4),
    max_staleness=st.integers(0, 4),
    trainer=st.integers(0, 8) | st.none(),
    policy_version=st.integers(0, 4),
)
def test_no_kept_token_is_older_than_the_bound(
    samples: list[list[int]],
    observation: list[int | None],
    max_staleness: int,
    trainer: int | None,
    policy_version: int,
) -> None:
    request = _request(max_staleness=max_staleness, policy_version=policy_version)
    pairs = enumerate(zip(samples, observation, strict=True))
    done = [_done(i, v, observation_at=o) for i, (v, o) in pairs]
    events = plan_events(2, 2, request) + list(done)
    state = rollout_state(events)
    ready = decide_ready(state, trainer)
    assert ready is not None
    current = max(policy_version, trainer if trainer is not None else policy_version)
    floor = current - max_staleness
    assert ready.trainer_version == current
    expected_stale, expected_tokens = [], 0
    for ev in done:
        sampled = ev.token_versions.numpy()[ev.loss_mask.numpy().astype(bool)]
        if ((sampled < 0) | (sampled < floor)).any():
            expected_stale.append(ev.sample_id)
            expected_tokens += len(sampled)
    assert ready.stale_sample_ids == expected_stale
    assert ready.stale_tokens == expected_tokens
    assert ready.metrics["n_stale"] == len(expected_stale)
    # what is kept has no sampled token older than the floor, nor of unknown version
    by_id = {e.sample_id: e for e in done}
    for sid in ready.sample_ids:
        ev = by_id[sid]
        assert state.samples[sid].completed
        sampled = ev.token_versions.numpy()[ev.loss_mask.numpy().astype(bool)]
        assert (sampled >= floor).all() and (sampled >= 0).all()
    assert set(ready.sample_ids) | set(ready.stale_sample_ids) == {e.sample_id for e in done}
    # the spread counts only kept tokens, all of them within the bound
    assert all(int(v) >= floor for v in ready.version_tokens)
    # pure: the same log and recorded version decide the same event
    assert decide_ready(rollout_state(events), ready.trainer_version) == ready


def test_a_sample_the_worker_ended_stale_is_excluded_and_counted() -> None:
    request = _request(max_staleness=0)
    events = plan_events(2, 2, request) + [
        _done(0, [3, 3]), _done(1, [3]), _done(2, [3, 3, 3]),
        SampleAborted(rollout_id=RID, sample_id=_sid(3), attempt=1,
                      abort_class=AbortClass.STALE, error="stale", turns=1),
    ]
    ready = decide_ready(rollout_state(events), 3)
    assert ready is not None
    assert ready.stale_sample_ids == [_sid(3)] and ready.stale_tokens == 0
    assert ready.sample_ids == [_sid(0), _sid(1), _sid(2)]
    assert ready.metrics["class/stale"] == 1.0


def test_without_a_bound_nothing_is_excluded_and_no_new_fields_appear() -> None:
    events = plan_events(2, 2, _request()) + [_done(i, [-1, 0]) for i in range(4)]
    ready = decide_ready(rollout_state(events), 50)
    assert ready is not None
    assert ready.trainer_version is None and ready.stale_sample_ids == []
    assert "n_stale" not in ready.metrics and "class/stale" not in ready.metrics
    fresh, stale, tokens = stale_split(rollout_state(events).ordered(), None)
    assert len(fresh) == 4 and not stale and tokens == 0


# ---------------------------------------------------------------- partial rollouts


@settings(max_examples=150, deadline=None)
@given(
    order=st.permutations(list(range(10))),
    cut=st.integers(min_value=0, max_value=10),
)
def test_partial_rollout_takes_the_first_whole_groups_in_log_order(
    order: list[int], cut: int
) -> None:
    """5 prompts planned (4 needed x 1.25), 2 samples each; samples end in ``order``, the
    first ``cut`` of them are in the log."""
    request = _request(n_prompts=4, overprovision=1.25)
    assert request.n_planned_prompts == 5
    events = plan_events(5, 2, request) + [_done(i, [1]) for i in order[:cut]]
    state = rollout_state(events)
    whole: list[int] = []
    seen: set[int] = set()
    for i in order[:cut]:
        seen.add(i)
        g = i // 2
        if {2 * g, 2 * g + 1} <= seen:
            whole.append(g)
    ready = decide_ready(state)
    assert worth_deciding(state) == (len(whole) >= 4)
    if len(whole) < 4:
        assert ready is None and select_groups(state) is None
        return
    assert ready is not None
    chosen = set(whole[:4])
    assert ready.sample_ids == [_sid(i) for i in range(10) if i // 2 in chosen]
    assert ready.tail_sample_ids == [_sid(i) for i in range(10) if i // 2 not in chosen]
    assert not ready.tail_carried
    aborts = tail_aborts(state, ready)
    assert [a.sample_id for a in aborts] == [
        s for s in ready.tail_sample_ids if not state.samples[s].done
    ]
    assert all(a.abort_class is AbortClass.TAIL_ABORTED for a in aborts)


def test_partial_replay_is_byte_identical_and_rows_name_the_tail() -> None:
    request = _request(n_prompts=2, overprovision=1.5, max_staleness=1)
    assert request.n_planned_prompts == 3
    body = plan_events(3, 2, request) + [
        _done(4, [2]), _done(0, [2]), _done(5, [1]), _done(1, [0, 2]), _done(2, [2]),
    ]
    state = rollout_state(body)
    ready = decide_ready(state, 2)
    assert ready is not None
    # groups 2 and 0 were whole first; sample 1 has a version-0 token: floor is 1
    assert ready.sample_ids == [_sid(0), _sid(4), _sid(5)]
    assert ready.stale_sample_ids == [_sid(1)]
    assert ready.tail_sample_ids == [_sid(2), _sid(3)]
    log = body + [ready, *tail_aborts(state, ready)]
    # through the wire format, as replay reads it
    envs = [Envelope(e.stream, e.id, decode(encode(e.event))) for e in envelopes(log)]
    replayed = replay_state(envs)
    live = rollout_of(body + [ready])
    assert render_artifacts(replayed) == render_artifacts(live)
    # re-deciding from the replayed stream (before the RolloutReady) gives the same event
    version = replayed.state.ready.trainer_version if replayed.state.ready else None
    assert decide_ready(rollout_state(body), version) == ready
    rows = {r.sample_id: r for r in sample_rows(replayed)}
    assert rows[_sid(3)].failure_class.value == "tail_aborted"
    assert rows[_sid(2)].failure_class.value != "tail_aborted"  # it ended before the ready
    summary = build_summary(replayed)
    assert summary["partial"] == {
        "overprovision": 1.5, "groups_needed": 2, "groups_planned": 3, "tail": "abort",
        "tail_samples": 2,
    }
    assert summary["staleness"]["excluded"] == 1 and summary["staleness"]["trainer_version"] == 2
    # the scheduler admits nothing more of it
    assert admission_refused(replayed.state) is not None
    assert admission_refused(rollout_state(body)) is None


def test_partial_options_are_validated_with_the_rollout_named() -> None:
    with pytest.raises(ValueError, match="request_stream"):
        _request(tail="carry")
    with pytest.raises(ValueError):
        _request(overprovision=0.5)
    with pytest.raises(ValueError):
        _request(max_staleness=-1)
    with pytest.raises(ConfigError, match="'r'.*training requests"):
        check_partial(_request(kind="eval", overprovision=1.25))
    with pytest.raises(ConfigError, match="'r'.*training requests"):
        check_partial(_request(kind="eval", tail="carry", request_stream="run-1"))
    check_partial(_request(tail="carry", request_stream="run-1", overprovision=1.5))
    assert _request(n_prompts=10, overprovision=1.1).n_planned_prompts == 11
    assert _request(n_prompts=8, overprovision=1.25).n_planned_prompts == math.ceil(8 * 1.25)


def test_a_v1_request_upcasts_to_no_bound_and_no_overprovisioning() -> None:
    raw = msgpack.unpackb(encode(_request(policy_version=4)), raw=False)
    assert raw["v"] == 2
    for key in ("max_staleness", "overprovision", "tail", "request_stream"):
        raw.pop(key)
    raw["v"] = 1  # as an archive written before v2 holds it
    old = decode(msgpack.packb(raw, use_bin_type=True))
    assert isinstance(old, RolloutRequested) and old.policy_version == 4
    assert old.max_staleness is None and old.overprovision == 1.0 and old.tail == "abort"
    assert old.request_stream is None and old.n_planned_prompts == old.n_prompts


def test_control_projection_follows_the_highest_published_version() -> None:
    projection = ControlProjection(keep_tails=1)
    state = projection.initial()
    assert state.current_version(_request(policy_version=2).policy_version) == 2
    for v in (3, 1, 5, 4):
        state = projection.evolve(state, Envelope("c", "1-0", PolicyVersionPublished(version=v)))
    assert state.published == 5
    assert state.current_version(_request(policy_version=9).policy_version) == 9
    for n in range(2):
        ready = RolloutReady(rollout_id=f"x{n}", sample_ids=[], tail_sample_ids=[f"x{n}:s1"])
        state = projection.evolve(state, Envelope("c", "2-0", ready))
    assert list(state.tails) == ["x1"]  # only the most recent kept
    assert np.array_equal(sorted(state.tails["x1"][1]), ["x1:s1"])


async def test_a_guarded_turn_is_refused_before_any_request_reaches_the_server() -> None:
    """The worker's per-turn check: a sample whose earlier turn ran below the floor gets no
    further generation (the server here does not exist: a request would fail otherwise),
    and the guarded backend still has token ids (the recording proxy needs them)."""
    from engine.actors.outcomes import ReportedAbort
    from engine.actors.sample_guard import SampleGuard
    from engine.backends.base import GenerationResult
    from engine.backends.pool import BackendPool
    from engine.outcomes import TerminationReason

    control = control_with(PolicyVersionPublished(version=3))
    guard = SampleGuard(_request(max_staleness=1), control, RID, _sid(0), 1)
    async with BackendPool("http://127.0.0.1:9") as pool:
        backend = pool.bind("k", hooks=(guard,)).get()
        assert backend.capabilities.token_ids
        guard.before_turn()  # nothing generated yet: the sample may start
        guard.record(GenerationResult(text="", token_ids=(1,), logprobs=(-0.1,),
                                      finish_reason="stop", weight_version=1))
        with pytest.raises(ReportedAbort) as refused:
            await backend.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
        assert refused.value.reason is TerminationReason.STALE and guard.turns == 1
        assert guard.in_flight == {}  # the refused call is in flight nowhere
