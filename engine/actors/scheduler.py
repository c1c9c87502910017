"""The scheduler actor: requests in, plans and admissions out, all through the log.

Event flow (docs/architecture.md, "Events and the log")
-------------------------------------------------------
1. Start-up: fold ``rl:pool``; append ``PoolDeclared`` (compare-and-append) when the log's
   declaration differs from this scheduler's layout (no layout declares an empty node set:
   ungated); run the deadlock check on the declared pool (``DeadlockError`` names the
   evaluator and both numbers).
2. ``RolloutRequested`` entries of ``rl:control`` are consumed through the consumer group
   ``schedulers``: each is delivered to one scheduler; a restarted scheduler re-reads its own
   pending entries; entries of a scheduler that died are claimed after ``claim_idle_ms``;
   entries being worked on are kept alive every ``heartbeat_ms``; a stopped scheduler hands
   its unfinished entries back (claimable at once, not counted as a delivery). A request
   delivered past the log's ``max_deliveries`` gets ``RolloutFailed`` before it is acked.
   Other event types on ``rl:control`` are acked and ignored. All of this is the actor
   runtime's (``GroupConsumer`` and ``serve``, :mod:`engine.runtime`), which every actor
   shares; dead requests are held (``ack_dead=False``) and settled once failed.
3. Plan (``Planner``, pure) and write it exclusively, in two kinds of step that each touch
   one cluster slot (``rl:data`` is on the control plane's, the rollout stream on its own):
   first one compare-and-append on ``rl:data`` (expected = the last id folded) appends the
   rollout's ``DataCursorAdvanced``, which reserves its data; then the plan's events go to
   ``rl:{rollout:<id>}`` (the copy of the request, causation = the control entry, every
   ``TaskFetched``, every ``BatchSealed``, ``RolloutPlanned``) in compare-and-appends of at
   most ``plan_chunk`` events, the first expecting the stream as folded, each later one the
   previous chunk's last id, so two writers (the planner and a scheduler resuming it) can
   never both append a chunk. A crash after the cursor or between chunks leaves a plan that
   is completed (never re-planned) from the recorded ``DataCursorAdvanced.previous``
   cursor, which reproduces the same events. On a conflict the scheduler refolds the stream
   it lost on; a rollout that already has its ``DataCursorAdvanced`` (or ``RolloutPlanned``)
   is never planned again.
4. Admit batches in ``seq`` order as capacity frees (``PoolGate``): ``TokenAcquired`` on
   ``rl:pool`` and ``BatchAdmitted`` on ``rl:work:{evaluator_id}`` in one compare-and-append;
   a batch the pool fold shows as acquired is skipped, so a resumed rollout admits only the
   rest. Waiting is a blocking read of ``rl:pool`` (evaluators' ``TokenReleased``). Without a
   layout the pool is ungated: batches are admitted at once, with node-less tokens, but
   still through the same compare-and-append on ``rl:pool``, which is the record that makes
   admission exactly-once across restarts (a ``BatchAdmitted`` appended on its own could not
   be told apart from one still to write after a crash). After the last batch,
   ``AdmissionClosed`` on ``rl:pool`` (once) closes the rollout's admission.
   While a weight sync is open or the last one failed (``engine.actors.weight_sync``), no
   batch is admitted: the scheduler follows ``rl:control`` (its one follower of the control
   projection) and waits before each admission until the new weights are active. A request whose
   ``policy_version`` has been published waits until that version is active too.
5. The ``RolloutRequested`` entry is acked once every batch is admitted. A request the
   configuration cannot serve (unknown dataset, deadlock for its real batch sizes, ...) gets
   ``RolloutFailed`` on ``rl:control`` and on its rollout stream, and is acked.

Several rollouts run at once, each an asyncio task; planning steps serialize on ``rl:data``
(the training cursor is a single sequence) and admissions on ``rl:pool``. Every step is one
atomic append, so a scheduler killed at any point (SIGKILL) leaves a log from which the next
one resumes: it folds the rollout stream and the pool and continues where the log stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.actors.admission import GateClosed, PoolGate, check_deadlock
from engine.actors.planning import (
    Plan,
    Planner,
    admission_refused,
    admission_wait,
    pace_wait,
)
from engine.config.layout import ClusterLayout
from engine.domain import EvaluatorProfile
from engine.errors import AppendConflict, ConfigError, PlacementError
from engine.events.base import Envelope
from engine.events.catalog import (
    BatchSealed,
    NodeDecl,
    PoolDeclared,
    RolloutFailed,
    RolloutRequested,
)
from engine.events.log import DeadEntry, EventLog
from engine.projections.control import ControlProjection, ControlState
from engine.projections.data_cursor import DataCursorProjection
from engine.projections.placement import pool_of
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer, ride_out
from engine.runtime.follower import Follower, FollowerClosed, following
from engine.runtime.loop import HandBack, serve

__all__ = [
    "SCHEDULER_GROUP",
    "Scheduler",
    "SchedulerConfig",
    "check_layout",
    "declaration_for",
]

logger = logging.getLogger(__name__)

SCHEDULER_GROUP = "schedulers"


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How one scheduler process takes part in the ``schedulers`` group.

    ``heartbeat_ms`` must be below ``claim_idle_ms`` (a live scheduler's entries are never
    claimed); ``plan_chunk`` bounds the events of one atomic append (Lua argument count).
    """

    scheduler_id: str
    group: str = SCHEDULER_GROUP
    block_ms: int = 2_000
    heartbeat_ms: int = 10_000
    claim_idle_ms: int = 60_000
    plan_chunk: int = 4_096
    outage_limit_s: float | None = 300.0

    def __post_init__(self) -> None:
        if self.heartbeat_ms >= self.claim_idle_ms:
            raise ConfigError(
                f"scheduler {self.scheduler_id!r}: heartbeat_ms ({self.heartbeat_ms}) must be "
                f"below claim_idle_ms ({self.claim_idle_ms})"
            )
        if self.plan_chunk < 2:
            raise ConfigError(f"plan_chunk must be at least 2, got {self.plan_chunk}")


def declaration_for(layout: ClusterLayout | None) -> PoolDeclared:
    """The ``PoolDeclared`` of a layout; no layout declares no nodes (ungated)."""
    if layout is None:
        return PoolDeclared(nodes=[])
    return PoolDeclared(
        nodes=[
            NodeDecl(node=n.name, gpus=list(n.gpus), cpu=n.cpu, memory_gb=n.memory_gb)
            for n in layout.nodes
        ]
    )


@dataclass
class _RolloutLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


def check_layout(specs: Mapping[str, EvaluatorProfile], layout: ClusterLayout | None) -> None:
    """The start-up deadlock check of ``specs`` against ``layout`` alone (no I/O)."""
    check_deadlock(specs.values(), pool_of(declaration_for(layout)))


class Scheduler:
    """Plans and admits the rollouts requested on ``rl:control`` (see module docstring)."""

    def __init__(
        self,
        log: EventLog,
        *,
        planner: Planner,
        layout: ClusterLayout | None,
        config: SchedulerConfig,
        control: Follower[ControlState] | None = None,
    ) -> None:
        self.log = log
        self.planner = planner
        self.config = config
        self.declaration = declaration_for(layout)
        self.gate = PoolGate(log, backoff=Backoff(limit_s=config.outage_limit_s))
        # rl:control, followed once: syncs and staleness bounds hold admissions back.
        self.control = control or Follower(
            log, log.names.control, ControlProjection(), block_ms=config.block_ms,
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self._data = Follower(log, log.names.data, DataCursorProjection(), owner=True)
        self.consumer = GroupConsumer(
            log,
            group=config.group,
            consumer=config.scheduler_id,
            streams=[log.names.control],
            heartbeat_ms=config.heartbeat_ms,
            claim_idle_ms=config.claim_idle_ms,
            block_ms=config.block_ms,
            ack_dead=False,  # settled once the rollout has its RolloutFailed
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self._rollout_locks: dict[str, _RolloutLock] = {}
        self.version_waits = 0
        self._started = False
        self.requests_handled = 0

    @property
    def claim_rounds(self) -> int:
        """How many times this scheduler has looked for idle entries to claim."""
        return self.consumer.claim_rounds

    # ------------------------------------------------------------ start-up

    async def start(self) -> None:
        """Declare the pool if the log's declaration differs, then run the deadlock check."""
        check_deadlock(self.planner.specs.values(), pool_of(self.declaration))
        await self.gate.declare(self.declaration)
        check_deadlock(self.planner.specs.values(), self.gate.state)
        await self.consumer.ensure_groups()
        self._started = True

    # ------------------------------------------------------------ serving

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; in-flight rollouts are handed back (pending, and
        claimable at once by another scheduler, or resumed by this one on a restart).

        Stopping is cooperative: the current blocking read finishes (at most ``block_ms``),
        rollouts waiting for capacity give up their wait, a plan being written finishes
        its current append. Nothing is cancelled in the middle of a Redis command, which
        redis-py does not survive reliably.
        """
        if not self._started:
            await ride_out(self.start, self.consumer.backoff, what="scheduler start-up")
        await ride_out(self.control.refresh, self.consumer.backoff, what="reading rl:control")

        async def stopping() -> None:
            self.control.close()
            self.gate.close()

        async with following(stop, self.gate.pool, self.control) as halt:
            await serve(
                self.consumer,
                halt,
                self._serve,
                on_dead=self._give_up,
                grace_s=None,
                on_stopping=stopping,
            )

    async def _serve(self, d: Delivery) -> None:
        ev = d.env.event
        if not isinstance(ev, RolloutRequested):
            return  # acked and ignored
        try:
            await self.handle(d.env, ev)
        except GateClosed as exc:
            logger.info("stopping: request %s handed back", d.env.ref)
            raise HandBack from exc

    async def _give_up(self, dead: DeadEntry) -> None:
        ev = dead.event
        if isinstance(ev, RolloutRequested):
            await self._fail(ev, f"schedulers gave up on the request: {dead.error}", dead.id)

    async def _fail(self, request: RolloutRequested, reason: str, entry_id: str) -> None:
        logger.error("rollout %s failed: %s", request.rollout_id, reason)
        failed = RolloutFailed(rollout_id=request.rollout_id, reason=reason)
        control = self.log.names.control
        targets = [control]
        try:
            targets.append(self.log.names.rollout(request.rollout_id))
        except ConfigError:
            pass  # a rollout id that cannot name a stream: the control stream alone says so
        await self.log.append_many(
            [(stream, failed) for stream in targets], causation=f"{control}@{entry_id}"
        )

    # ------------------------------------------------------------ one rollout

    async def handle(self, env: Envelope, request: RolloutRequested) -> None:
        """Plan (or resume) and admit one requested rollout; returns when all is admitted.

        A request the configuration cannot serve is recorded as ``RolloutFailed`` instead.
        """
        # Two entries for one rollout (a client retry) run one after the other here; across
        # processes the log's compare-and-appends keep them exclusive.
        rid = request.rollout_id
        entry = self._rollout_locks.setdefault(rid, _RolloutLock())
        entry.users += 1
        try:
            async with entry.lock:
                try:
                    batches = await self._ensure_planned(env, request)
                    if batches is not None:
                        await self._admit(env, batches)
                except (ConfigError, PlacementError) as exc:
                    await self._fail(request, str(exc), env.id)
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._rollout_locks[rid]
        self.requests_handled += 1

    async def _admit(self, env: Envelope, batches: list[BatchSealed]) -> None:
        specs = self.planner.specs
        unknown = sorted({b.evaluator_id for b in batches if b.evaluator_id not in specs})
        if unknown:
            # Checked before any admission: a resumed rollout planned under another evaluator
            # config must not end half admitted.
            raise ConfigError(
                f"rollout {batches[0].rollout_id!r} was planned for evaluators {unknown}, which "
                f"the evaluator config does not define (known: {sorted(specs)})"
            )
        request = env.event
        version = request.policy_version if isinstance(request, RolloutRequested) else 0
        # A pinned eval runs on servers serving its version, which no sync touches.
        pinned = isinstance(request, RolloutRequested) and request.pinned_version is not None
        # A partial rollout done with its groups admits no more batches, and a
        # bounded one waits while no published version can meet its bound.
        watch = isinstance(request, RolloutRequested) and (
            request.n_planned_prompts > request.n_prompts or request.max_staleness is not None
        )
        rollout = Follower(
            self.log, self.log.names.rollout(batches[0].rollout_id), RolloutProjection()
        )
        for batch in batches:
            if self.gate.state.has_acquired(batch.rollout_id, batch.batch_id):
                continue
            if watch and not await self._admissible(rollout, batch.rollout_id):
                break  # the rest will never be admitted: admission closes here
            try:  # no admission while weights change, after a failed sync, or before the
                # version the request asks for is active (when it was published)
                if not pinned:
                    await self._generation_allowed(version)
            except FollowerClosed as exc:
                raise GateClosed(f"stopping before batch {batch.batch_id!r} was admitted") from exc
            await self.gate.admit(batch, specs[batch.evaluator_id], causation=env.ref)
        await self.gate.close_admission(batches[0].rollout_id, causation=env.ref)

    async def _generation_allowed(self, version: int) -> None:
        """Return once no sync is open, the engine is not poisoned and work asking for
        policy ``version`` may run (``ControlState.may_generate``); at once if so."""
        state = self.control.state
        if not state.may_generate(version):
            logger.info(
                "admission paused: %s",
                state.why_stopped() or f"version {version} is published but not active yet",
            )
        await self.control.wait_for(lambda s: s.may_generate(version))

    async def _admissible(self, rollout: Follower[RolloutState], rollout_id: str) -> bool:
        """Whether the rollout's next batch may be admitted (False: it never will be);
        waits while its staleness bound is out of reach or its ``pace`` policy holds it
        (``pace_wait``; rl:control may move either; the rollout stream is looked at again
        every half second)."""
        said = False
        while True:
            await rollout.refresh()
            if (why := admission_refused(rollout.state)) is not None:
                logger.info("rollout %s: %s; batches left unadmitted", rollout_id, why)
                return False
            seen = self.control.version
            control = self.control.state
            wait = admission_wait(rollout.state, control.published) or pace_wait(
                rollout.state.request, control
            )
            if wait is None:
                return True
            if self.gate.closed:
                raise GateClosed(f"stopping while rollout {rollout_id} waits: {wait}")
            if not said:
                logger.info("rollout %s: admission waits: %s", rollout_id, wait)
                said = True
            self.version_waits += 1
            try:
                await self.control.changed(seen, 0.5)
            except FollowerClosed as exc:
                raise GateClosed(f"stopping while rollout {rollout_id} waits: {wait}") from exc

    async def _ensure_planned(
        self, env: Envelope, request: RolloutRequested
    ) -> list[BatchSealed] | None:
        """The rollout's batches in seq order, planning or completing the plan if needed;
        ``None`` when the rollout already failed."""
        rid = request.rollout_id
        rollout = Follower(self.log, self.log.names.rollout(rid), RolloutProjection())
        rollout_at: str | None = None
        data_at: str | None = None
        while True:
            await rollout.refresh(at_least=rollout_at)
            await self._data.refresh(at_least=data_at)
            rollout_at = data_at = None
            state = rollout.state
            if state.failed is not None:
                return None
            if state.planned is not None:
                return _planned_batches(state)
            advanced = self._data.state.rollouts.get(rid)
            try:
                if advanced is not None:
                    plan = self.planner.replan(request, advanced, self._data.state)
                    await self._complete(plan, rollout, env)
                else:
                    plan = self.planner.plan(request, self._data.state)
                    check_deadlock(
                        [self.planner.specs[e] for e in plan.largest_batches()],
                        self.gate.state,
                        batch_samples=plan.largest_batches(),
                    )
                    await self._write(plan, rollout, env)
            except AppendConflict as exc:
                if exc.stream == self._data.stream:
                    data_at = exc.current
                else:
                    rollout_at = exc.current
                continue
            return list(plan.batches)

    async def _write(self, plan: Plan, rollout: Follower[RolloutState], env: Envelope) -> None:
        """The cursor on ``rl:data`` (the data is now this rollout's), then the plan's
        events chained on the rollout stream (module docstring, step 3)."""
        ids = await self.log.append_if_last(
            self._data.stream, plan.cursor, self._data.position, causation=env.ref
        )
        self._data.apply([Envelope(self._data.stream, ids[0], plan.cursor)])
        await self._append_chained(rollout.stream, plan, 0, rollout.position, env)

    async def _complete(self, plan: Plan, rollout: Follower[RolloutState], env: Envelope) -> None:
        """Append the part of ``plan`` the rollout stream does not have yet."""
        state = rollout.state
        n_tasks = len(plan.sample_ids)
        present = (
            (1 if state.request is not None else 0)
            + len(state.samples)
            + len(state.batches)
            + (1 if state.planned is not None else 0)
        )
        expected_samples = set(plan.sample_ids[: max(0, present - 1)])
        expected_batches = {b.batch_id for b in plan.batches[: max(0, present - 1 - n_tasks)]}
        if (
            (present > 0 and state.request is None)
            or set(state.samples) != expected_samples
            or set(state.batches) != expected_batches
        ):
            raise ConfigError(
                f"rollout {plan.rollout_id!r}: the partly written plan on the log differs from "
                f"the plan recomputed from its DataCursorAdvanced (did the rollout config, the "
                f"evaluator config or the batching strategy change?)"
            )
        logger.info(
            "rollout %s: completing an interrupted plan (%d of %d events written)",
            plan.rollout_id,
            present,
            plan.n_events,
        )
        await self._append_chained(rollout.stream, plan, present, rollout.position, env)

    async def _append_chained(
        self, stream: str, plan: Plan, start: int, expected: str, env: Envelope
    ) -> None:
        """Append events ``start..`` of ``plan`` in chunks, each expecting the last id of the
        one before (so only the writer that holds the chain can continue it)."""
        chunk = self.config.plan_chunk
        for i in range(start, plan.n_events, chunk):
            ids = await self.log.append_if_last(
                stream, plan.rollout_events(i, i + chunk), expected, causation=env.ref
            )
            expected = ids[-1]


def _planned_batches(state: RolloutState) -> list[BatchSealed]:
    planned = state.planned
    assert planned is not None
    batches = sorted(state.batches.values(), key=lambda b: b.seq)
    if len(batches) != planned.n_batches:
        raise ConfigError(
            f"rollout {planned.rollout_id!r}: RolloutPlanned lists {planned.n_batches} batches "
            f"but the rollout stream has {len(batches)} BatchSealed"
        )
    return batches
