"""Staleness policies per request (``RolloutRequested.staleness_policy``): ``drop`` excludes
stale samples, ``keep`` loads them in their groups' statistics without gradient, ``pace``
admits a rollout's batches only where its samples can meet the bound. Pure decisions driven
from events (given / when / then), the pace rule checked against a simulated trainer loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.actors.outcomes import ReportedAbort
from engine.actors.planning import pace_wait
from engine.actors.sample_guard import SampleGuard
from engine.backends.base import GenerationResult
from engine.client import RolloutClient
from engine.collate import collate
from engine.errors import ConfigError
from engine.events import (
    Envelope,
    FilterSpec,
    LogProbs,
    Mask,
    PolicyVersionActivated,
    PolicyVersionPublished,
    RolloutFailed,
    RolloutReady,
    RolloutRequested,
    SampleCompleted,
    TokenIds,
)
from engine.events.codec import decode, encode
from engine.events.memory_log import MemoryEventLog
from engine.outcomes import TerminationReason
from engine.projections.control import ControlProjection, ControlState
from engine.projections.decision import decide_ready
from engine.projections.samples import trainer_samples
from engine.projections.summary import build_summary
from tests.rig import control_with, plan_events, rollout_of, rollout_state

RID = "r"


def _sid(i: int) -> str:
    return f"{RID}:s{i}"


def _request(**kw: object) -> RolloutRequested:
    base: dict[str, object] = {"rollout_id": RID, "n_prompts": 2, "n_samples_per_prompt": 2}
    base.update(kw)
    return RolloutRequested.model_validate(base)


def _done(i: int, version: int, reward: float) -> SampleCompleted:
    """A completed sample of three sampled tokens, all of weight ``version``."""
    return SampleCompleted(
        rollout_id=RID, sample_id=_sid(i), attempt=1,
        prompt_ids=TokenIds.from_values([1]), response_ids=TokenIds.from_values([7, 8, 9]),
        logprobs=LogProbs.from_values([-0.5] * 3), loss_mask=Mask.from_values([1, 1, 1]),
        reward=reward, termination_reason="finish",
        token_versions=TokenIds.from_values([version] * 3),
    )


# ---------------------------------------------------------------- the field


def test_an_old_request_without_a_policy_reads_as_drop() -> None:
    request = _request(max_staleness=1)
    payload = request.model_dump(mode="json")
    del payload["staleness_policy"]
    assert RolloutRequested.model_validate(payload).staleness_policy == "drop"
    kept = _request(max_staleness=1, staleness_policy="keep")
    assert decode(encode(kept)) == kept


async def test_an_unknown_policy_is_refused_at_request_time_naming_field_and_values() -> None:
    log = MemoryEventLog()
    client = RolloutClient(log)
    with pytest.raises(ConfigError, match=r"staleness_policy must be one of drop, keep, pace; "
                                          r"got 'discard'"):
        await client.request(iteration=0, n_prompts=1, max_staleness=1,
                             staleness_policy="discard")  # type: ignore[arg-type]
    assert await log.read_all(log.names.control) == []  # nothing half-valid reached the log
    await client.request(iteration=0, n_prompts=1, max_staleness=1, staleness_policy="keep")
    await client.request(iteration=1, n_prompts=1, max_staleness=1)
    keep, default = [e.event for e in await log.read_all(log.names.control)]
    assert isinstance(keep, RolloutRequested) and keep.staleness_policy == "keep"
    # the client's default is the measured one (bench/staleness.py): pace
    assert isinstance(default, RolloutRequested) and default.staleness_policy == "pace"


# ---------------------------------------------------------------- keep


def _mixed_group(policy: str, **kw: object) -> tuple[RolloutRequested, list[SampleCompleted]]:
    """Group 0: s0 fresh (v3, reward 1) and s1 stale (v1, reward 0); group 1: both fresh."""
    request = _request(max_staleness=1, policy_version=3, staleness_policy=policy, **kw)
    return request, [_done(0, 3, 1.0), _done(1, 1, 0.0), _done(2, 3, 1.0), _done(3, 2, 0.0)]


def test_keep_loads_a_stale_sample_in_its_group_and_lists_it_as_stale() -> None:
    # given a group with one fresh and one stale sample, under keep
    request, done = _mixed_group("keep")
    # when the rollout is decided with the trainer at version 3 (floor 2)
    ready = decide_ready(rollout_state([*plan_events(2, 2, request), *done]), 3)
    # then the stale sample is loaded (in sample_ids) and named stale
    assert ready is not None
    assert ready.sample_ids == [_sid(0), _sid(1), _sid(2), _sid(3)]
    assert ready.stale_sample_ids == [_sid(1)] and ready.stale_tokens == 3
    assert ready.metrics["n_stale"] == 1 and ready.metrics["n_stale_kept"] == 1
    # and under drop the same log excludes it
    dropped = decide_ready(rollout_state([*plan_events(2, 2, _mixed_group("drop")[0]), *done]), 3)
    assert dropped is not None and dropped.sample_ids == [_sid(0), _sid(2), _sid(3)]
    assert dropped.stale_sample_ids == [_sid(1)] and "n_stale_kept" not in dropped.metrics


def test_keep_counts_the_stale_reward_in_the_group_statistics() -> None:
    # given reward-equal rejection: group 0's rewards differ only through its stale sample
    filters = FilterSpec(reject_equal_rewards=True)
    keep, done = _mixed_group("keep", filters=filters)
    drop, _ = _mixed_group("drop", filters=filters)
    # when decided under each policy
    kept = decide_ready(rollout_state([*plan_events(2, 2, keep), *done]), 3)
    dropped = decide_ready(rollout_state([*plan_events(2, 2, drop), *done]), 3)
    assert kept is not None and dropped is not None
    # then keep sees two rewards in group 0 and keeps the group; drop sees one and rejects it
    assert kept.sample_ids == [_sid(0), _sid(1), _sid(2), _sid(3)]
    assert dropped.sample_ids == [_sid(2), _sid(3)] and dropped.dropped_sample_ids == [_sid(0)]


def test_a_kept_stale_sample_collates_with_no_gradient_and_its_reward() -> None:
    # given a rollout decided under keep with a stale sample
    request, done = _mixed_group("keep")
    events = [*plan_events(2, 2, request), *done]
    ready = decide_ready(rollout_state(events), 3)
    assert ready is not None
    # when the trainer loads and collates it
    samples = trainer_samples(rollout_of([*events, ready]))
    batch = collate(samples)
    # then its row says stale, its loss mask is all zeros, it is no removed sample
    assert batch["stale"].tolist() == [False, True, False, False]
    assert batch["loss_mask"][1].sum() == 0 and batch["loss_mask"][0].sum() == 3
    assert batch["remove_sample"].tolist() == [False] * 4
    assert batch["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert samples[1].stale and not any(samples[1].loss_mask.tolist())
    assert "stale" not in samples[0].model_dump()  # a fresh sample's dump has no such key


def test_a_keep_summary_names_the_policy_and_a_drop_summary_keeps_its_shape() -> None:
    for policy, expected in (("keep", {"policy": "keep", "kept_stale": 1, "excluded": 0}),
                             ("drop", {"excluded": 1})):
        request, done = _mixed_group(policy)
        events = [*plan_events(2, 2, request), *done]
        ready = decide_ready(rollout_state(events), 3)
        assert ready is not None
        staleness = build_summary(rollout_of([*events, ready]))["staleness"]
        assert {k: staleness[k] for k in expected} == expected
        assert ("policy" in staleness) is (policy != "drop")


@settings(max_examples=100, deadline=None)
@given(
    versions=st.lists(st.integers(-1, 4), min_size=4, max_size=4),
    trainer=st.integers(0, 6),
    max_staleness=st.integers(0, 2),
)
def test_keep_loads_what_drop_loads_plus_the_completed_stale_samples(
    versions: list[int], trainer: int, max_staleness: int
) -> None:
    done = [_done(i, v, float(i % 2)) for i, v in enumerate(versions)]

    def decided(policy: str) -> RolloutReady:
        request = _request(max_staleness=max_staleness, staleness_policy=policy)
        ready = decide_ready(rollout_state([*plan_events(2, 2, request), *done]), trainer)
        assert ready is not None
        return ready

    drop, keep = decided("drop"), decided("keep")
    assert keep.stale_sample_ids == drop.stale_sample_ids
    assert set(keep.sample_ids) == set(drop.sample_ids) | set(drop.stale_sample_ids)
    assert keep.sample_ids == sorted(keep.sample_ids)  # index order
    assert keep.dummy is (not versions)


def test_the_guard_lets_a_stale_sample_of_a_keep_rollout_run_on() -> None:
    # given the trainer at version 3 and a sample whose first turn ran on version 1
    control = control_with(PolicyVersionPublished(version=3))
    turn = GenerationResult(text="", token_ids=(1,), logprobs=(-0.1,), finish_reason="stop",
                            weight_version=1)
    keep = SampleGuard(_request(max_staleness=1, staleness_policy="keep"), control, RID,
                       _sid(0), 1)
    drop = SampleGuard(_request(max_staleness=1), control, RID, _sid(0), 1)
    for guard in (keep, drop):
        guard.record(turn)
    # when each asks for its next turn: keep goes on, drop ends the attempt as stale
    keep.before_turn()
    with pytest.raises(ReportedAbort) as refused:
        drop.before_turn()
    assert refused.value.reason is TerminationReason.STALE


# ---------------------------------------------------------------- pace


def _fold(events: list[object]) -> ControlState:
    projection = ControlProjection()
    state = projection.initial()
    for n, ev in enumerate(events):
        state = projection.evolve(state, Envelope("c", f"{n + 1}-0", ev))  # type: ignore[arg-type]
    return state


def _paced(rid: str, **kw: object) -> RolloutRequested:
    return RolloutRequested.model_validate({
        "rollout_id": rid, "n_prompts": 1, "max_staleness": 0, "staleness_policy": "pace", **kw,
    })


def test_pace_holds_a_rollout_until_the_one_before_it_is_trained_on() -> None:
    # given two paced rollouts with max_staleness 0, the first one running
    a, b = _paced("a"), _paced("b")
    assert pace_wait(a, _fold([a, b])) is None
    assert "1 earlier bounded rollouts are not yet trained on" in str(pace_wait(b, _fold([a, b])))
    # when the first becomes ready, b still waits: the trainer's step on it is to come
    ready = RolloutReady(rollout_id="a", sample_ids=[])
    assert pace_wait(b, _fold([a, b, ready])) is not None
    # when the trainer publishes the step's weights, b waits for them to be active
    published = PolicyVersionPublished(version=1)
    assert "version 1 is published, not active yet" in str(
        pace_wait(b, _fold([a, b, ready, published])))
    # then, with version 1 active, b is admitted
    active = PolicyVersionActivated(version=1, servers=["s"])
    assert pace_wait(b, _fold([a, b, ready, published, active])) is None


def test_pace_counts_only_bounded_training_rollouts_and_lets_failed_ones_go() -> None:
    unbounded = RolloutRequested(rollout_id="u", n_prompts=1)
    dropped = RolloutRequested(rollout_id="d", n_prompts=1, max_staleness=0)
    b = _paced("b")
    state = _fold([unbounded, dropped, b])
    assert state.rollouts_ahead("b") == 1  # the drop rollout's step will publish too
    assert pace_wait(b, _fold([unbounded, dropped, b, RolloutFailed(rollout_id="d",
                                                                    reason="x")])) is None
    assert pace_wait(_paced("b", max_staleness=1), state) is None  # one step ahead is allowed
    assert pace_wait(_request(max_staleness=0), state) is None  # not paced


@settings(max_examples=200, deadline=None)
@given(
    ahead=st.integers(0, 3),
    max_staleness=st.integers(0, 2),
    steps=st.lists(st.integers(0, 3), max_size=80),
)
def test_under_pace_no_admitted_sample_is_decided_beyond_its_bound(
    ahead: int, max_staleness: int, steps: list[int]
) -> None:
    """A ``RefillLoop``-like trainer (``ahead`` rollouts requested beyond the one it waits
    for, one publication per step, in order) and a syncer activating each publication, in
    any interleaving with the rollouts' completions: a rollout the pace rule admitted is
    decided with the trainer at most ``max_staleness`` versions past the version its
    samples started on; and the loop always runs to its end (no wait without a way out)."""
    n_rollouts = 6
    projection = ControlProjection()
    log: list[object] = []
    state = projection.initial()

    def append(ev: object) -> None:
        nonlocal state
        log.append(ev)
        state = projection.evolve(state, Envelope("c", f"{len(log)}-0", ev))  # type: ignore[arg-type]

    version = 0
    requested: list[RolloutRequested] = []
    pending: list[str] = []  # the trainer's queue, oldest first
    admitted: dict[str, int] = {}  # rollout -> version its samples start on
    decided: dict[str, int] = {}  # rollout -> trainer version at its decision

    def request_more() -> None:
        while len(requested) < n_rollouts and len(pending) < ahead + 1:
            rid = f"r{len(requested)}"
            ev = _paced(rid, max_staleness=max_staleness, policy_version=version)
            requested.append(ev)
            pending.append(rid)
            append(ev)

    def admit() -> bool:  # the scheduler admits in request order
        nxt = next((r for r in requested if r.rollout_id not in admitted), None)
        if nxt is None or pace_wait(nxt, state) is not None:
            return False
        if not state.may_generate(nxt.policy_version):
            return False
        assert state.active_version in (None, state.published)
        admitted[nxt.rollout_id] = state.active_version or 0
        return True

    def finish(k: int) -> bool:  # one admitted rollout becomes ready
        running = [r for r in admitted if r not in decided]
        if not running:
            return False
        rid = running[k % len(running)]
        decided[rid] = state.current_version()
        append(RolloutReady(rollout_id=rid, sample_ids=[]))
        return True

    def step() -> bool:  # the trainer steps on its oldest rollout once ready
        nonlocal version
        if not pending or pending[0] not in decided:
            return False
        pending.pop(0)
        version += 1
        append(PolicyVersionPublished(version=version))
        request_more()
        return True

    def activate() -> bool:
        if state.published is None or not state.needs_sync(state.published):
            return False
        append(PolicyVersionActivated(version=state.published, servers=["s"]))
        return True

    actions = (admit, lambda: finish(len(log)), step, activate)
    request_more()
    for choice in steps:
        actions[choice]()
    # Drain, the trainer and syncer first: something can always happen until the end.
    drain = (activate, step, admit, lambda: finish(0))
    for _ in range(20 * n_rollouts):
        if not any(action() for action in drain):
            break
    assert len(decided) == n_rollouts and not pending
    for rid, start in admitted.items():
        assert decided[rid] - start <= max_staleness, (rid, start, decided[rid])
