"""Admission: the deadlock check, the pure admission decision, and the pool gate.

Deadlock check
--------------
For every evaluator profile::

    tokens_needed = min(budget_tokens(profile.resource, profile.sample_resource), max batch samples)
    pool_capacity = max_tokens_for(pool, profile.sample_resource)

and ``pool_capacity < tokens_needed`` raises ``DeadlockError`` naming the evaluator and both
numbers: such a batch could never be admitted and the run would hang. At start-up the
largest batch is the profile's ``batch_size``; a profile without one may put a whole rollout in
one batch, so only its budget bounds the need. Once a rollout is planned its real batch
sizes are checked the same way (``check_deadlock(..., batch_samples=plan.largest_batches())``).
A budget that pays for no token at all is refused too (``needs 1 ... its budget pays for 0``).

Admission decision (pure)
-------------------------
``decide_admission(pool, batch, profile)`` answers ``None`` (wait for capacity) or the two
events of an admission: ``TokenAcquired`` for ``rl:pool`` and ``BatchAdmitted`` for
``rl:work:{evaluator_id}`` carrying the sample ids, the token ids, each token's node and
the GPU ids each token's grant holds a share of (tokens without GPU shares are left out): the
evaluator stamps the GPU on every ``TurnCompleted``, which is what ``placement.jsonl`` shows.
An ungated pool (no layout) admits at once with node-less tokens (see ``placement``).

Pool gate (the imperative shell around the decision)
----------------------------------------------------
``PoolGate`` keeps one scheduler process's fold of ``rl:pool`` current and admits batches:
``admit(batch, profile)`` decides on the fold and writes both events with one compare-and-append
on ``rl:pool`` (the ``BatchAdmitted`` rides in ``also``), so tokens and admission are one
atomic step and two schedulers can never over-allocate: the loser of a race gets
``AppendConflict``, folds the new tail and decides again. A batch that the fold shows as
already acquired (by this or another scheduler, before a crash or during a claim race) is
never acquired again. When the batch does not fit, ``admit`` waits for the fold to change;
the gate's follower (``pool``, :mod:`engine.runtime.follower`) feeds the fold from blocking
reads of ``rl:pool`` (``TokenReleased`` from evaluator workers wakes it), never by
sleep-polling, and rides out an outage with the runtime's backoff. Ungated admissions go
through the same compare-and-append: the pool stream is the record that makes admission
exactly-once across restarts, gated or not.

Both events of an admission live on the control plane's cluster slot (``rl:pool`` and every
work stream share one hash tag, ``engine.events.names``), so on a Redis Cluster too the
admission stays one atomic script. After a rollout's last admission the scheduler appends
``AdmissionClosed`` (``close_admission``: a compare-and-append, once per rollout): a
scheduler resuming the request admits nothing more, and the pool fold forgets the rollout's
batches once they are released (``engine.projections.placement``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine import metrics
from engine.domain import EvaluatorProfile
from engine.errors import AppendConflict, DeadlockError
from engine.events.base import Envelope
from engine.events.catalog import (
    AdmissionClosed,
    BatchAdmitted,
    BatchSealed,
    PoolDeclared,
    TokenAcquired,
)
from engine.events.log import EventLog
from engine.projections.placement import (
    PoolProjection,
    PoolState,
    budget_tokens,
    describe_resource,
    max_tokens_for,
    try_acquire_batch,
)
from engine.runtime.consumer import Backoff
from engine.runtime.follower import Follower, FollowerClosed

__all__ = [
    "Admission",
    "GateClosed",
    "PoolGate",
    "check_deadlock",
    "decide_admission",
    "tokens_needed",
]


def tokens_needed(spec: EvaluatorProfile, batch_samples: int | None) -> int:
    """Tokens a batch of ``batch_samples`` (None: unknown, any size) of ``spec`` needs."""
    budget = budget_tokens(spec.resource, spec.sample_resource)
    return budget if batch_samples is None else min(budget, batch_samples)


def _pool_summary(pool: PoolState) -> str:
    if not pool.gated:
        return "ungated"
    nodes = ", ".join(
        f"{n.name}: {len(n.decl.gpus)} gpus, {n.decl.cpu:g} cpu, {n.decl.memory_gb:g} GB"
        for n in pool.nodes.values()
    )
    return f"{len(pool.nodes)} nodes ({nodes})"


def check_deadlock(
    specs: Iterable[EvaluatorProfile],
    pool: PoolState,
    *,
    batch_samples: Mapping[str, int] | None = None,
) -> None:
    """Raise ``DeadlockError`` if some profile needs more tokens than the pool can ever give.

    ``batch_samples`` maps evaluator id to its largest batch; profiles not in it use their
    ``batch_size`` (None: bounded by the budget only). Profiles absent from a given
    ``batch_samples`` mapping are still checked, with their ``batch_size``.
    """
    for spec in specs:
        per_sample = spec.sample_resource
        budget = budget_tokens(spec.resource, per_sample)
        if budget < 1:
            raise DeadlockError(
                f"Deadlock: evaluator {spec.evaluator_id!r} needs 1 placement token of "
                f"{describe_resource(per_sample)} per sample but its budget "
                f"({describe_resource(spec.resource)}) pays for 0: raise its resource budget"
            )
        largest = (batch_samples or {}).get(spec.evaluator_id, spec.batch_size)
        needed = budget if largest is None else min(budget, largest)
        capacity = max_tokens_for(pool, per_sample)
        if capacity < needed:
            batch = "any size (batch_size=None)" if largest is None else f"{largest} samples"
            raise DeadlockError(
                f"Deadlock: evaluator {spec.evaluator_id!r} needs {needed} placement "
                f"tokens (budget pays for {budget}, largest batch {batch}) of "
                f"{describe_resource(per_sample)} but the pool can only provide {capacity} "
                f"({_pool_summary(pool)}); lower the evaluator's budget or batch_size, or "
                f"give the cluster layout more capacity"
            )


@dataclass(frozen=True, slots=True)
class Admission:
    """The two events of one admission: tokens on the pool, the batch on its work stream."""

    acquired: TokenAcquired
    admitted: BatchAdmitted


def decide_admission(
    pool: PoolState, batch: BatchSealed, spec: EvaluatorProfile
) -> Admission | None:
    """Admit ``batch`` now (the events to write) or ``None`` (it does not fit yet)."""
    grants = try_acquire_batch(
        pool,
        spec.resource,
        spec.sample_resource,
        len(batch.sample_ids),
        token_prefix=batch.batch_id,
    )
    if grants is None:
        return None
    acquired = TokenAcquired(
        rollout_id=batch.rollout_id,
        batch_id=batch.batch_id,
        evaluator_id=batch.evaluator_id,
        tokens=grants,
    )
    admitted = BatchAdmitted(
        rollout_id=batch.rollout_id,
        batch_id=batch.batch_id,
        evaluator_id=batch.evaluator_id,
        sample_ids=list(batch.sample_ids),
        token_ids=[g.token_id for g in grants],
        nodes={g.token_id: g.node for g in grants},
        gpus={g.token_id: [share.gpu for share in g.gpus] for g in grants if g.gpus},
    )
    return Admission(acquired, admitted)


class GateClosed(Exception):
    """``PoolGate.close()`` was called while a batch waited for admission."""


def pool_figures(state: PoolState) -> dict[tuple[str, str], float]:
    """What ``rollout_pool`` shows (``engine.metrics``): used and total per resource."""
    nodes = state.nodes.values()
    return {
        ("cpu", "used"): sum(n.cpu_used for n in nodes),
        ("cpu", "total"): sum(n.decl.cpu for n in nodes),
        ("gpu", "used"): sum(n.gpu_used_total for n in nodes),
        ("gpu", "total"): float(sum(len(n.decl.gpus) for n in nodes)),
        ("memory_gb", "used"): sum(n.memory_used for n in nodes),
        ("memory_gb", "total"): sum(n.decl.memory_gb for n in nodes),
        ("tokens", "used"): float(state.tokens_held),
        ("batches", "used"): float(len(state.held)),
    }


class PoolGate:
    """One process's view of ``rl:pool`` and its compare-and-append admissions: ``pool`` is
    its follower (run by the scheduler beside its loop). The scheduler owns ``rl:pool``: its
    gate dead-letters entries there that do not decode."""

    def __init__(self, log: EventLog, *, backoff: Backoff | None = None) -> None:
        self._log = log
        self.pool = Follower(log, log.names.pool, PoolProjection(), owner=True, backoff=backoff)
        self._write = asyncio.Lock()
        self.conflicts = 0
        self.admitted = 0
        metrics.watch_pool(lambda: pool_figures(self.state))

    @property
    def stream(self) -> str:
        return self.pool.stream

    @property
    def state(self) -> PoolState:
        return self.pool.state

    @property
    def position(self) -> str:
        return self.pool.position

    async def refresh(self, *, at_least: str | None = None) -> None:
        """Fold the tail of ``rl:pool`` past the current position."""
        await self.pool.refresh(at_least=at_least)

    @property
    def closed(self) -> bool:
        return self.pool.closed

    def close(self) -> None:
        """Stop following ``rl:pool`` after the current read and make waiting ``admit``
        calls raise ``GateClosed`` (their batches stay unadmitted for whoever resumes the
        rollout)."""
        self.pool.close()

    async def declare(self, declaration: PoolDeclared, *, causation: str | None = None) -> bool:
        """Append ``declaration`` unless the pool already has the same node set.

        A pool with no declaration and an empty (ungated) declaration are the same. Returns
        whether an event was appended.
        """
        async with self._write:
            await self.refresh()
            while True:
                current = self.state.declared
                current_nodes = [] if current is None else current.nodes
                if current_nodes == declaration.nodes:
                    return False
                try:
                    ids = await self._log.append_if_last(
                        self.stream, declaration, self.position, causation=causation
                    )
                except AppendConflict as exc:
                    self.conflicts += 1
                    await self.refresh(at_least=exc.current)
                    continue
                self.pool.apply([Envelope(self.stream, ids[0], declaration)])
                return True

    async def close_admission(self, rollout_id: str, *, causation: str | None = None) -> bool:
        """Record that every batch of ``rollout_id`` is admitted (``AdmissionClosed``),
        unless the pool already says so; returns whether an event was appended."""
        event = AdmissionClosed(rollout_id=rollout_id)
        async with self._write:
            while not self.state.is_closed(rollout_id):
                try:
                    ids = await self._log.append_if_last(
                        self.stream, event, self.position, causation=causation
                    )
                except AppendConflict as exc:
                    self.conflicts += 1
                    await self.refresh(at_least=exc.current)
                    continue
                self.pool.apply([Envelope(self.stream, ids[0], event)])
                return True
        return False

    async def admit(
        self, batch: BatchSealed, spec: EvaluatorProfile, *, causation: str | None = None
    ) -> BatchAdmitted | None:
        """Admit ``batch`` exactly once, waiting for capacity as long as it takes.

        Returns the ``BatchAdmitted`` written, or ``None`` when the fold shows the batch was
        already acquired (by an earlier run or another scheduler).
        """
        work = self._log.names.work(batch.evaluator_id)
        while True:
            if self.closed:
                raise GateClosed(f"pool gate closed before batch {batch.batch_id!r} was admitted")
            async with self._write:
                if self.state.has_acquired(batch.rollout_id, batch.batch_id):
                    return None
                decision = decide_admission(self.state, batch, spec)
                if decision is not None:
                    try:
                        ids = await self._log.append_if_last(
                            self.stream,
                            decision.acquired,
                            self.position,
                            also=[(work, decision.admitted)],
                            causation=causation,
                        )
                    except AppendConflict as exc:
                        self.conflicts += 1
                        await self.refresh(at_least=exc.current)
                        continue
                    self.admitted += 1
                    self.pool.apply([Envelope(self.stream, ids[0], decision.acquired)])
                    return decision.admitted
                seen = self.pool.version
            metrics.ADMISSION_WAITS.labels(batch.evaluator_id).inc()
            with metrics.BATCHES_WAITING.labels(batch.evaluator_id).track_inprogress():
                try:
                    await self.pool.changed(seen)
                except FollowerClosed:
                    pass  # raised as GateClosed above
