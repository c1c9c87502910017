"""The evaluator worker: consumes admitted batches and runs each as a ``BatchRun``.

Contract
--------
* Input: ``BatchAdmitted`` on ``rl:work:{evaluator_id}`` for each evaluator id the worker
  serves, read through the consumer group ``evaluators`` (one consumer per worker process).
  Up to ``max_batches`` batches run at once in one process.
* Tasks come from the rollout stream through the worker's ``TaskReader``
  (:mod:`engine.actors.task_reader`): per rollout (an LRU of ``task_cache_rollouts``) an
  index of the task entries and the last ``task_window`` entries as read, so a worker's
  memory follows its batches in flight, not the rollout's size.
* The worker runs on the actor runtime (``engine.runtime.loop.serve``); what to re-run,
  which tokens to reuse and what to abort are pure functions of the folds
  (:mod:`engine.actors.recovery`), tested without Redis.
* A fresh delivery runs every sample of the batch as attempt 1 with the batch's tokens.
  A *redelivered* batch (this consumer's own pending entry after a restart, or one claimed
  from a consumer idle past ``claim_idle_ms``) is planned from the folded rollout stream:
  only samples without a terminal event run, each as ``attempt = previous attempt + 1``;
  the tokens are those the pool projection says the batch still holds (a ``Follower`` of
  ``rl:pool``, refreshed only for recoveries); and the sandbox provider (when one is
  configured) reaps whatever the previous workers left running for the batch (selected by
  the labels of :func:`engine.actors.sandbox_labels.sandbox_labels`).
* An entry dead-lettered for too many deliveries aborts its non-terminal samples as
  ``infra_other`` (phase ``delivery``) and releases the tokens the batch still holds. The
  entry is acked only after those events are in Redis; a worker dying in between leaves it
  pending, and the worker that claims it next dead-letters it again and finishes the abort
  (the folds ignore a repeated abort, and tokens already released are not released again).
  A worker restarted under the same name counts re-reading its own pending batches as a
  delivery too, so a batch that kills its worker every time ends up aborted, not in a
  crash loop.
* A batch is acked only after every sample of it has a terminal event *in Redis* (the
  group-commit appender is flushed first), so an acked batch never needs running again.
* Transport errors are not failures: a flush that cannot reach Redis is retried (capped
  backoff) until it gets through or the outage limit makes the process exit; the batch
  stays this worker's meanwhile (episodes run on without Redis). A batch is never given
  back, released or handed back while the appender still holds events for it, so its next
  owner never re-runs a sample whose result is only queued here.
* Fencing: a redelivered batch is leased before it is planned (``BatchLeased`` on
  ``rl:pool`` with the entry's delivery count); every ``TokenReleased`` carries the lease
  it ran under, and the pool ignores releases of an older lease. Attempts are numbered
  ``max(previous + 1, lease)``, so a re-run never reuses an attempt a previous holder may
  still write. When the heartbeat finds the batch claimed by another worker (this one
  stalled past the idle window), its run here is cancelled (its episodes clean up their
  own sandboxes); a batch waiting for a slot is kept alive like a running one, and one
  found claimed never runs here. A recovery whose pool shows a newer lease than its own
  (a stale copy) runs and reaps nothing (:mod:`engine.actors.recovery`).
* Model servers (``engine/backends/health.py``): the worker runs its pool's health probes,
  starts from the servers' state on ``rl:control`` and appends each change it sees there
  (``ServerDown`` / ``ServerUp`` / ``ServerStale``, ``engine/events/catalog/servers.py``); before it
  takes work it brings each server to a known version (``ServerHealth.admit``: one that
  reports none before any sync is labelled version 0), and a server comes back only at the
  active policy version. A model-server failure is retried (the turn,
  else the attempt) within each sample's ``model_retries``; a sample whose budget is spent is
  aborted naming the servers tried, and a rollout whose samples waited past the outage limit
  with every server down fails (``engine/actors/batch_run.py``).
* Weight sync (``engine.actors.weight_sync``): the worker follows ``rl:control`` (one
  follower, which its batches' sample guards read too; past the outage limit it ends the
  process with ``OutageExceeded``) and steers its backend pool's ``TurnGate`` (the pool's
  first hook): while a sync is open or the engine is poisoned no model call starts (calls
  in flight finish), so trajectories wait at a turn boundary; once nothing is in flight it
  appends ``WorkerParked``. An activation opens the gate again.
* Shutdown (``stop`` set, e.g. by SIGTERM): no new batch is taken; running batches get
  ``grace_s`` to finish; the rest are cancelled and handed back (claimable at once, not
  counted as a delivery) -- samples that finished are recorded, the others re-run on the
  worker that claims the batch. Work is never dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.actors.batch_run import BatchPlan, BatchRun, EpisodeSettings, OnTaskDone
from engine.actors.prompt_store import PromptStore
from engine.actors.recovery import dead_letter_events, plan_recovery
from engine.actors.sandbox_labels import sandbox_labels
from engine.actors.task_reader import TaskReader
from engine.actors.verify import VerifyPolicy, check_servers
from engine.actors.weight_sync import WorkerQuiesce
from engine.agents.binding import EvaluatorBinding
from engine.backends.gate import TurnGate
from engine.backends.health import HealthChange, ServerState
from engine.backends.pool import BackendPool
from engine.errors import ConfigError
from engine.events.base import Event
from engine.events.catalog import BatchAdmitted, BatchLeased
from engine.events.catalog.servers import ServerDown, ServerStale, ServerUp
from engine.events.log import DeadEntry, EventLog
from engine.projections.control import ControlProjection, ControlState
from engine.projections.placement import PoolProjection, PoolState
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.appender import GroupAppender
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer, ride_out
from engine.runtime.follower import Follower, following
from engine.runtime.loop import LeaseLost, serve
from engine.runtime.readback import read_tasks
from engine.runtime.rebuild import rebuild
from engine.sandbox.base import SandboxProvider

__all__ = ["BatchReport", "EvaluatorWorker", "WorkerConfig"]

logger = logging.getLogger(__name__)

GROUP = "evaluators"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """Settings of one evaluator worker process."""

    worker_id: str
    evaluator_ids: tuple[str, ...]
    max_batches: int = 4
    heartbeat_ms: int = 10_000
    claim_idle_ms: int = 60_000
    block_ms: int | None = None
    grace_s: float = 30.0
    tmp_root: Path | None = None
    cleanup_timeout_s: float = 120.0
    task_cache_rollouts: int = 16
    task_window: int = 2048  # task entries of a rollout kept as read (engine.actors.task_reader)
    group: str = GROUP
    outage_limit_s: float | None = 300.0
    verify: VerifyPolicy = VerifyPolicy()
    model_retries: int = 4
    retry_backoff_s: float = 0.5

    def __post_init__(self) -> None:
        if not self.evaluator_ids:
            raise ValueError("a worker needs at least one evaluator id")
        if self.max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {self.max_batches}")
        if self.task_window < 0:
            raise ValueError(f"task_window must be at least 0, got {self.task_window}")


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What the ``on_batch_done`` callback hears when a batch is done: its events are in
    Redis and the runtime acks the entry next."""

    rollout_id: str
    batch_id: str
    evaluator_id: str
    ran: int
    completed: int
    aborted: int
    redelivered: bool


class EvaluatorWorker:
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        specs: Mapping[str, EvaluatorBinding],
        config: WorkerConfig,
        *,
        backends: BackendPool | None = None,
        sandboxes: SandboxProvider | None = None,
        on_task_done: OnTaskDone | None = None,
        on_batch_done: Callable[[BatchReport], None] | None = None,
        control: Follower[ControlState] | None = None,
    ) -> None:
        missing = [e for e in config.evaluator_ids if e not in specs]
        if missing:
            raise ValueError(
                f"worker {config.worker_id}: no evaluator spec for {missing} "
                f"(known: {sorted(specs)})"
            )
        self.log = log
        self.names = log.names
        self.specs = dict(specs)
        self.config = config
        self._backends = backends
        self._sandboxes = sandboxes
        self._on_task_done = on_task_done
        self._on_batch_done = on_batch_done
        self._settings = EpisodeSettings(
            worker_id=config.worker_id,
            tmp_root=config.tmp_root,
            cleanup_timeout_s=config.cleanup_timeout_s,
            verify=config.verify,
            model_retries=config.model_retries,
            retry_backoff_s=config.retry_backoff_s,
        )
        self.tasks = TaskReader(
            log, window=config.task_window, rollouts=config.task_cache_rollouts
        )
        self._prompts = PromptStore()  # a group's prompt tokens stored once (batch_run)
        self.sink = GroupAppender(log)
        self.consumer = GroupConsumer(
            log,
            group=config.group,
            consumer=config.worker_id,
            streams=[self.names.work(e) for e in config.evaluator_ids],
            heartbeat_ms=config.heartbeat_ms,
            claim_idle_ms=config.claim_idle_ms,
            block_ms=config.block_ms,
            ack_dead=False,  # settled once _abort_dead has the aborts in Redis
            limit_own_pending=True,  # a worker crash-looping on a batch aborts it
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        # The pool as far as recoveries needed it: which tokens a batch still holds.
        self._pool = Follower(log, self.names.pool, PoolProjection())
        self._pool_lock = asyncio.Lock()
        # rl:control, followed once: the weight sync steers the gate (quiesce), and every
        # batch's samples read the staleness bound and the tails of ready rollouts.
        self.control = control or Follower(
            log, self.names.control, ControlProjection(), block_ms=config.block_ms,
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self.quiesce = WorkerQuiesce(
            log,
            backends.gate if backends is not None else TurnGate(),
            worker_id=config.worker_id,
            control=self.control,
        )
        if backends is not None:  # servers are readmitted at the active version only
            backends.health.expected = lambda: self.control.state.active_version
            backends.health.listen(self._server_changed)
        self.batches_done = 0
        self.batches_handed_back = 0

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve batches until ``stop`` is set, then shut down as the module docstring says.
        A model server that reports temperature-scaled logprobs is refused first."""
        await check_servers(self._backends, threshold=self.config.verify.threshold)
        stop = stop or asyncio.Event()
        steering: asyncio.Task[None] | None = None
        probing: asyncio.Task[None] | None = None
        done = asyncio.Event()
        try:
            await self.quiesce.start(self.consumer.backoff)  # a sync may be open already
            if self._backends is not None:  # the fleet as the log has it, then our probes
                self._backends.health.adopt(self.control.state.servers)
                await self._backends.health.admit()  # each server at a known version first
                probing = asyncio.create_task(self._backends.health.run(done))
            async with following(stop, self.control) as halt:
                steering = asyncio.create_task(self.quiesce.run())
                served = await serve(
                    self.consumer,
                    halt,
                    self._run_delivery,
                    on_dead=self._abort_dead,
                    capacity=self.config.max_batches,
                    grace_s=self.config.grace_s,
                    before_hand_back=self.sink.flush,  # what finished is in Redis first
                    settle_writes=self.sink.flush,  # nothing queued for work given up
                )
            self.batches_handed_back += served.handed_back
        finally:
            done.set()
            waits = [t for t in (steering, probing) if t is not None]
            await asyncio.gather(*waits, return_exceptions=True)  # end with the follower
            await self.sink.aclose()

    def _server_changed(self, change: HealthChange) -> None:
        """A policy server changed state here: say so on ``rl:control``."""
        worker = self.config.worker_id
        event: Event
        if change.state is ServerState.UP:
            event = ServerUp(endpoint=change.endpoint, worker=worker,
                             weight_version=change.version)
        elif change.state is ServerState.DOWN:
            event = ServerDown(endpoint=change.endpoint, worker=worker, reason=change.reason)
        else:
            assert change.expected is not None
            event = ServerStale(endpoint=change.endpoint, worker=worker,
                                weight_version=change.version, active=change.expected,
                                reason=change.reason)  # fmt: skip
        self.sink.emit([(self.names.control, event)])

    # ------------------------------------------------------------------ one batch

    async def _run_delivery(self, d: Delivery) -> None:
        ev = d.env.event
        if not isinstance(ev, BatchAdmitted):
            logger.warning("ignoring %s on work stream %s", ev.type, d.env.stream)
            return  # acked
        spec = self.specs.get(ev.evaluator_id)
        if spec is None:  # the stream names the id, so only a hand-written entry gets here
            raise ConfigError(
                f"no evaluator {ev.evaluator_id!r} for batch {ev.batch_id}; leaving it pending"
            )
        plan = await (self._recovery_plan(d, ev) if d.redelivered else self._fresh_plan(d, ev))
        evaluator = BatchRun(
            spec,
            plan,
            sink=self.sink,
            names=self.names,
            settings=self._settings,
            backends=self._backends,
            sandboxes=self._sandboxes,
            on_task_done=self._on_task_done,
            control=self.control,
            prompts=self._prompts,
        )
        await evaluator.run()
        await self._flush()  # every terminal event in Redis before the runtime acks
        self.batches_done += 1
        if self._on_batch_done is not None:
            self._on_batch_done(
                BatchReport(
                    rollout_id=ev.rollout_id,
                    batch_id=ev.batch_id,
                    evaluator_id=ev.evaluator_id,
                    ran=len(plan.run_ids),
                    completed=evaluator.completed,
                    aborted=evaluator.aborted,
                    redelivered=d.redelivered,
                )
            )

    async def _fresh_plan(self, d: Delivery, ev: BatchAdmitted) -> BatchPlan:
        request, tasks = await self.tasks.batch_tasks(ev.rollout_id, ev.sample_ids)
        return BatchPlan(
            admitted=ev,
            request=request,
            tasks=tasks,
            run_ids=tuple(ev.sample_ids),
            attempts={},
            tokens=tuple(ev.token_ids),
            causation=d.env.ref,
            lease=d.deliveries,
        )

    async def _flush(self) -> None:
        """Flush the appender through an outage (a retried write may repeat events, which
        the folds ignore); past the outage limit ``OutageExceeded`` ends the process."""
        await ride_out(self.sink.flush, self.consumer.backoff, what="writing batch events")

    async def _recovery_plan(self, d: Delivery, ev: BatchAdmitted) -> BatchPlan:
        await self._flush()  # our own earlier writes for it are in the log first
        if ev.token_ids:  # fence off the previous holder's late releases
            await self.log.append(
                self.names.pool,
                BatchLeased(
                    rollout_id=ev.rollout_id,
                    batch_id=ev.batch_id,
                    lease=d.deliveries,
                    worker=self.config.worker_id,
                ),
                causation=d.env.ref,
            )
        pool = await self._pool_now()  # the pool first, then the rollout (see recovery)
        state = await self._fold(ev.rollout_id)
        plan = plan_recovery(state, pool, ev, lease=d.deliveries)
        if plan.superseded:
            raise LeaseLost(
                f"batch {ev.batch_id} was taken over under a newer lease than delivery "
                f"{d.deliveries}; not running it here"
            )
        if plan.run_ids and ev.token_ids and not plan.tokens:
            logger.warning(
                "batch %s: %d samples to re-run but every token was released; running ungated",
                ev.batch_id,
                len(plan.run_ids),
            )
        await self._reap_previous(ev, plan.reap_workers)
        logger.info(
            "worker %s recovers batch %s (delivery %d): %d of %d samples to re-run, "
            "%d tokens held",
            self.config.worker_id,
            ev.batch_id,
            d.deliveries,
            len(plan.run_ids),
            len(ev.sample_ids),
            len(plan.tokens),
        )
        stream = self.names.rollout(ev.rollout_id)
        return BatchPlan(
            admitted=ev,
            request=state.request,
            tasks=await read_tasks(self.log, stream, state, plan.run_ids),
            run_ids=plan.run_ids,
            attempts=plan.attempts,
            tokens=plan.tokens,
            causation=d.env.ref,
            lease=d.deliveries,
        )

    async def _fold(self, rollout_id: str) -> RolloutState:
        return (await rebuild(self.log, self.names.rollout(rollout_id), RolloutProjection())).state

    async def _pool_now(self) -> PoolState:
        """The pool folded up to now (only recoveries and dead letters ask)."""
        async with self._pool_lock:
            await self._pool.refresh()
        return self._pool.state

    async def _reap_previous(self, ev: BatchAdmitted, workers: Sequence[str]) -> None:
        if self._sandboxes is None:
            return
        for worker in workers:
            selector = sandbox_labels(worker=worker, rollout_id=ev.rollout_id, batch_id=ev.batch_id)
            try:
                n = await self._sandboxes.reap(selector)
            except Exception as exc:  # reaping is best effort; the batch still runs
                logger.warning(
                    "reaping sandboxes of %s for %s failed: %s", worker, ev.batch_id, exc
                )
                continue
            logger.info("reaped %d sandboxes %s left for batch %s", n, worker, ev.batch_id)

    # ------------------------------------------------------------------ dead letters

    async def _abort_dead(self, entry: DeadEntry) -> None:
        ev = entry.event
        if not isinstance(ev, BatchAdmitted):
            return  # nothing it stood for can be aborted
        pool = await self._pool_now()
        state = await self._fold(ev.rollout_id)
        settle = dead_letter_events(
            state,
            pool,
            ev,
            entry_id=entry.id,
            error=entry.error,
            causation=f"{entry.stream}@{entry.id}",
            lease=entry.deliveries,
        )
        await self._reap_previous(ev, settle.reap_workers)
        stream = self.names.rollout(ev.rollout_id)
        items: list[tuple[str, Event]] = [(stream, abort) for abort in settle.aborts]
        if settle.release is not None:
            items.append((self.names.pool, settle.release))
        self.sink.emit(items)
        await self._flush()  # in Redis before the consumer settles (acks) the entry
        logger.warning(
            "batch %s dead-lettered after %d deliveries: %d samples aborted as infra_other",
            ev.batch_id,
            entry.deliveries,
            len(settle.aborts),
        )
