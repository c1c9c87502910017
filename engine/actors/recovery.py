"""What a worker does with a batch someone may already have run: pure decisions.

A *redelivered* batch (a restart's own pending entry, or one claimed from a dead worker)
and a *dead-lettered* one are decided from two folds, never from scans of the log:

* the rollout stream (``RolloutState``, its records): which of the batch's samples have a
  terminal event, the attempt each reached, and which worker last started them;
* the placement pool (``PoolState``): which of the batch's tokens it still holds.

:func:`plan_recovery` re-runs only the samples without a terminal event, each as
``attempt = max(previous attempt + 1, lease)`` where ``lease`` is the work entry's delivery
count (so a re-run never reuses the number of an attempt a previous holder started but had
not written yet), with the tokens the batch still holds, and names the workers whose
sandboxes for the batch are to be reaped.

A sandbox is reaped only when its owner's lease is over. The runtime keeps every entry a
worker holds alive (running or waiting for a slot), so an entry is claimed only from a holder
that kept nothing alive for a whole idle window: it died, or it stalled and stops its work at
its next heartbeat. The pool then tells whether the claim is still the newest: a
``BatchLeased`` with a higher lease than ours means another worker took the batch over after
us (this delivery is a stale copy); the plan is then ``superseded`` and runs and reaps
nothing, so the live holder's sandboxes are never reaped under it.

The caller appends ``BatchLeased`` before it folds the pool and then the rollout stream, in
that order: every release that got in before the lease was written by a holder whose
samples' terminal events are already in the rollout stream (a sample's release follows its
terminal event), so the samples to re-run never outnumber what the held tokens can serve;
releases after it are fenced off.
:func:`dead_letter_events` aborts the same samples as ``infra_other`` (phase
``delivery``) and releases what the batch still holds; repeating it after a crash
repeats events the folds ignore.

A batch the pool has no acquisition for (an admission written without one, as by hand)
keeps every admitted token: nothing can have released them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.events.catalog import AbortClass, BatchAdmitted, SampleAborted, TokenReleased
from engine.projections.placement import PoolState
from engine.projections.rollout import RolloutState

__all__ = [
    "DeadLetterAborts",
    "Recovery",
    "dead_letter_events",
    "held_tokens",
    "not_terminal",
    "plan_recovery",
]


@dataclass(frozen=True, slots=True)
class Recovery:
    """How to run a batch again: samples, their attempts, tokens, sandboxes to reap."""

    run_ids: tuple[str, ...]
    attempts: dict[str, int]
    tokens: tuple[str, ...]
    reap_workers: tuple[str, ...]
    superseded: bool = False  # a newer lease holds the batch: nothing to do here


@dataclass(frozen=True, slots=True)
class DeadLetterAborts:
    """The events that settle a dead-lettered batch: aborts first, then the release."""

    aborts: tuple[SampleAborted, ...]
    release: TokenReleased | None
    reap_workers: tuple[str, ...]


def not_terminal(state: RolloutState, sample_ids: Sequence[str]) -> list[str]:
    """Samples of the batch without a terminal event (unknown ids included: they abort)."""
    return [sid for sid in sample_ids if (s := state.samples.get(sid)) is None or not s.done]


def held_tokens(pool: PoolState, admitted: BatchAdmitted) -> tuple[str, ...]:
    """The batch's admitted tokens the pool still holds, in admission order."""
    if not pool.has_acquired(admitted.rollout_id, admitted.batch_id):
        return tuple(admitted.token_ids)
    held = pool.held_by(admitted.rollout_id, admitted.batch_id)
    return tuple(t for t in admitted.token_ids if t in held)


def _workers(state: RolloutState, run_ids: Sequence[str]) -> tuple[str, ...]:
    """Workers that last started any of ``run_ids`` (their sandboxes may still run)."""
    return tuple(
        sorted(
            {
                r.worker
                for sid in run_ids
                if (r := state.samples.get(sid)) is not None and r.worker
            }
        )
    )


def plan_recovery(
    state: RolloutState, pool: PoolState, admitted: BatchAdmitted, *, lease: int = 1
) -> Recovery:
    """The re-run of a redelivered batch (see the module docstring)."""
    if pool.leases.get((admitted.rollout_id, admitted.batch_id), 0) > lease:
        return Recovery(run_ids=(), attempts={}, tokens=(), reap_workers=(), superseded=True)
    run_ids = not_terminal(state, admitted.sample_ids)
    attempts = {
        sid: max(
            (state.samples[sid].attempt if sid in state.samples else 0) + 1, lease, 1
        )
        for sid in run_ids
    }
    return Recovery(
        run_ids=tuple(run_ids),
        attempts=attempts,
        tokens=held_tokens(pool, admitted) if admitted.token_ids else (),
        reap_workers=_workers(state, run_ids),
    )


def dead_letter_events(
    state: RolloutState,
    pool: PoolState,
    admitted: BatchAdmitted,
    *,
    entry_id: str,
    error: str,
    causation: str,
    lease: int = 0,
) -> DeadLetterAborts:
    """Abort the batch's unfinished samples and release its tokens (module docstring)."""
    run_ids = not_terminal(state, admitted.sample_ids)
    aborts = tuple(
        SampleAborted(
            rollout_id=admitted.rollout_id,
            sample_id=sid,
            attempt=max(state.samples[sid].attempt, 1) if sid in state.samples else 1,
            abort_class=AbortClass.INFRA_OTHER,
            error=f"work entry {entry_id} dead-lettered: {error}",
            phase="delivery",
            causation=causation,
        )
        for sid in run_ids
    )
    held = list(held_tokens(pool, admitted))
    release = (
        TokenReleased(
            rollout_id=admitted.rollout_id,
            batch_id=admitted.batch_id,
            token_ids=held,
            reason="dead_letter",
            causation=causation,
            lease=lease,
        )
        if held
        else None
    )
    return DeadLetterAborts(aborts=aborts, release=release, reap_workers=_workers(state, run_ids))
