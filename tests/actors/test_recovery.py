"""The recovery plan and dead-letter aborts of a batch: pure functions of the rollout fold
and the pool fold, driven here with hand-built events (no Redis)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.actors.recovery import dead_letter_events, held_tokens, plan_recovery
from engine.events import (
    AbortClass,
    BatchAdmitted,
    BatchLeased,
    Envelope,
    Event,
    RolloutRequested,
    SampleAborted,
    SampleStarted,
    TokenAcquired,
    TokenReleased,
)
from engine.events.catalog import TokenGrant
from engine.projections.placement import PoolProjection, PoolState
from engine.projections.rollout import RolloutProjection, RolloutState
from tests.actors.play import plan_events

REQUEST = RolloutRequested(rollout_id="r", n_prompts=4)


def admissions() -> tuple[list[Event], list[tuple[TokenAcquired, BatchAdmitted]]]:
    return plan_events(REQUEST, batch_size=4, tokens_per_batch=3)


def rollout(*events: Event) -> RolloutState:
    plan, _ = admissions()
    projection = RolloutProjection()
    state = projection.initial()
    for i, ev in enumerate([*plan, *events]):
        state = projection.evolve(state, Envelope("rl:{rollout:r}", f"{i + 1}-0", ev))
    return state


def pool(*events: Event) -> PoolState:
    projection = PoolProjection()
    state = projection.initial()
    for i, ev in enumerate(events):
        state = projection.evolve(state, Envelope("rl:pool", f"{i + 1}-0", ev))
    return state


def started(sid: str, attempt: int, worker: str) -> SampleStarted:
    return SampleStarted(rollout_id="r", sample_id=sid, attempt=attempt, batch_id="r:b0",
                         worker=worker, node="n1")


def aborted(sid: str, attempt: int) -> SampleAborted:
    return SampleAborted(rollout_id="r", sample_id=sid, attempt=attempt,
                         abort_class=AbortClass.INFRA_CONN, error="x", phase="run")


def released(tokens: Sequence[str] | None) -> TokenReleased:
    return TokenReleased(rollout_id="r", batch_id="r:b0",
                         token_ids=None if tokens is None else list(tokens))


def test_a_recovery_reruns_only_unfinished_samples_one_attempt_later() -> None:
    _, [(acquired, admitted)] = admissions()
    state = rollout(started("r:s0", 1, "w1"), aborted("r:s0", 1),
                    started("r:s1", 2, "w1"), started("r:s2", 1, "w2"))
    plan = plan_recovery(state, pool(acquired), admitted)
    assert plan.run_ids == ("r:s1", "r:s2", "r:s3")
    assert plan.attempts == {"r:s1": 3, "r:s2": 2, "r:s3": 1}
    assert plan.tokens == ("r:b0:t0", "r:b0:t1", "r:b0:t2")
    assert plan.reap_workers == ("w1", "w2")  # w1 started r:s1, w2 r:s2


def test_a_recovery_reuses_only_the_tokens_the_pool_says_the_batch_holds() -> None:
    _, [(acquired, admitted)] = admissions()
    state = rollout()
    assert plan_recovery(state, pool(acquired, released(["r:b0:t1"])), admitted).tokens == (
        "r:b0:t0", "r:b0:t2",
    )
    everything = pool(acquired, released(["r:b0:t1"]), released(None))
    assert plan_recovery(state, everything, admitted).tokens == ()
    # Releases of another batch, or repeated ones, change nothing.
    other = TokenReleased(rollout_id="r", batch_id="r:b9", token_ids=None)
    assert held_tokens(pool(acquired, other, released(["r:b0:t0"]) ,
                            released(["r:b0:t0"])), admitted) == ("r:b0:t1", "r:b0:t2")


def test_a_batch_the_pool_never_saw_acquire_keeps_its_admitted_tokens() -> None:
    _, [(_acquired, admitted)] = admissions()
    assert plan_recovery(rollout(), pool(), admitted).tokens == tuple(admitted.token_ids)
    ungated = admitted.model_copy(update={"token_ids": [], "nodes": {}, "gpus": {}})
    assert plan_recovery(rollout(), pool(), ungated).tokens == ()


def test_a_finished_batch_has_nothing_to_rerun() -> None:
    _, [(acquired, admitted)] = admissions()
    state = rollout(*(aborted(f"r:s{i}", 1) for i in range(4)))
    plan = plan_recovery(state, pool(acquired, released(None)), admitted)
    assert plan.run_ids == () and plan.attempts == {} and plan.reap_workers == ()


def test_a_dead_lettered_batch_aborts_its_unfinished_samples_and_releases_its_tokens() -> None:
    _, [(acquired, admitted)] = admissions()
    state = rollout(started("r:s0", 2, "w1"), aborted("r:s1", 1))
    settle = dead_letter_events(
        state, pool(acquired, released(["r:b0:t2"])), admitted,
        entry_id="5-0", error="delivered 4 times", causation="rl:work:scripted@5-0",
    )
    assert [(a.sample_id, a.attempt) for a in settle.aborts] == [
        ("r:s0", 2), ("r:s2", 1), ("r:s3", 1),
    ]
    for a in settle.aborts:
        assert a.abort_class is AbortClass.INFRA_OTHER and a.phase == "delivery"
        assert a.error == "work entry 5-0 dead-lettered: delivered 4 times"
        assert a.causation == "rl:work:scripted@5-0"
    assert settle.release is not None
    assert settle.release.token_ids == ["r:b0:t0", "r:b0:t1"]
    assert settle.release.reason == "dead_letter"
    assert settle.reap_workers == ("w1",)


def test_settling_a_dead_letter_again_releases_nothing_more() -> None:
    # A worker died after writing the aborts and the release: the next one repeats the
    # aborts (the fold ignores them) and finds no token left to release.
    _, [(acquired, admitted)] = admissions()
    first = dead_letter_events(rollout(), pool(acquired), admitted,
                               entry_id="5-0", error="e", causation="c")
    assert first.release is not None
    state = rollout(*first.aborts)
    again = dead_letter_events(state, pool(acquired, first.release), admitted,
                               entry_id="5-0", error="e", causation="c")
    assert again.aborts == () and again.release is None


def test_unknown_samples_of_a_dead_batch_abort_as_attempt_one() -> None:
    grant = TokenGrant(token_id="x:t0", node="")
    admitted = BatchAdmitted(rollout_id="r", batch_id="x", evaluator_id="scripted",
                             sample_ids=["r:s99"], token_ids=["x:t0"])
    acquired = TokenAcquired(rollout_id="r", batch_id="x", evaluator_id="scripted",
                             tokens=[grant])
    settle = dead_letter_events(rollout(), pool(acquired), admitted,
                                entry_id="1-0", error="e", causation="c")
    assert [(a.sample_id, a.attempt) for a in settle.aborts] == [("r:s99", 1)]
    assert settle.release is not None and settle.release.token_ids == ["x:t0"]


def test_a_rerun_never_reuses_an_attempt_a_previous_holder_may_still_write() -> None:
    # Holder 1 started r:s1 as attempt 1 but its SampleStarted never reached the log (it
    # was queued when the batch moved on): the log shows r:s1 never started. The holder
    # of delivery 3 runs it as attempt 3, above any attempt an earlier holder used.
    _, [(acquired, admitted)] = admissions()
    state = rollout(started("r:s0", 1, "w1"), aborted("r:s0", 1), started("r:s2", 3, "w2"))
    plan = plan_recovery(state, pool(acquired), admitted, lease=3)
    assert plan.attempts == {"r:s1": 3, "r:s2": 4, "r:s3": 3}


def test_late_releases_of_a_previous_holder_are_fenced_off() -> None:
    _, [(acquired, admitted)] = admissions()

    def release(tokens: list[str], lease: int) -> TokenReleased:
        return TokenReleased(rollout_id="r", batch_id="r:b0", token_ids=tokens, lease=lease)

    lease2 = BatchLeased(rollout_id="r", batch_id="r:b0", lease=2, worker="w2")
    # Before the lease, holder 1's releases count (its samples are terminal in the log).
    state = pool(acquired, release(["r:b0:t0"], 1), lease2)
    assert held_tokens(state, admitted) == ("r:b0:t1", "r:b0:t2")
    # After it, holder 1's late release is ignored: holder 2 still uses r:b0:t1 ...
    state = pool(acquired, release(["r:b0:t0"], 1), lease2, release(["r:b0:t1"], 1))
    assert held_tokens(state, admitted) == ("r:b0:t1", "r:b0:t2") and state.fenced == 1
    # ... and holder 2's own release (or a dead letter's, above any lease) is applied.
    state = pool(acquired, lease2, release(["r:b0:t1"], 2), release(["r:b0:t2"], 4))
    assert held_tokens(state, admitted) == ("r:b0:t0",) and state.fenced == 0
    # A log written before leases existed (lease 0, no BatchLeased) folds as before.
    assert pool(acquired, released(None)).tokens_held == 0


def leased(lease: int, worker: str) -> BatchLeased:
    return BatchLeased(rollout_id="r", batch_id="r:b0", lease=lease, worker=worker)


def test_a_stale_copy_of_a_batch_taken_over_since_runs_and_reaps_nothing() -> None:
    # Given w2 claimed the batch under lease 3 and started r:s1 there,
    # when w1 recovers from delivery 2 (a copy it read before w2's claim),
    # then the plan is superseded: no re-run, no token, and w2's sandboxes are not reaped.
    _, [(acquired, admitted)] = admissions()
    state = rollout(started("r:s1", 3, "w2"))
    plan = plan_recovery(state, pool(acquired, leased(2, "w1"), leased(3, "w2")), admitted,
                         lease=2)
    assert plan.superseded
    assert (plan.run_ids, plan.tokens, plan.reap_workers) == ((), (), ())
    # The newest lease plans as usual and reaps the previous holder's sandboxes.
    newest = plan_recovery(state, pool(acquired, leased(3, "w2"), leased(4, "w1")), admitted,
                           lease=4)
    assert not newest.superseded and newest.reap_workers == ("w2",)
