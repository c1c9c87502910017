"""The evaluator worker: consumes admitted batches and runs each through an ``Evaluator``.

Contract
--------
* Input: ``BatchAdmitted`` on ``rl:work:{evaluator_id}`` for each evaluator id the worker
  serves, read through the consumer group ``evaluators`` (one consumer per worker process).
  Up to ``max_batches`` batches run at once in one process.
* Tasks come from folding the rollout stream: the worker keeps, per rollout (an LRU of
  ``task_cache_rollouts``), the ``TaskFetched`` events and the request copy, and reads
  further only when a batch names a sample it has not seen.
* A fresh delivery runs every sample of the batch as attempt 1 with the batch's tokens.
  A *redelivered* batch (this consumer's own pending entry after a restart, or one claimed
  from a consumer idle past ``claim_idle_ms``) is planned from the folded rollout stream:
  only samples without a terminal event run, each as ``attempt = previous attempt + 1``;
  the tokens are those of the admission minus the ones already released on ``rl:pool``;
  and the sandbox provider (when one is configured) reaps whatever the previous workers
  left running for the batch (selected by the labels of :func:`sandbox_labels`).
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
* Shutdown (``stop`` set, e.g. by SIGTERM): no new batch is taken; running batches get
  ``grace_s`` to finish; the rest are cancelled and left pending -- samples that finished
  are recorded, the others re-run on the worker that claims the batch. Work is never
  dropped.

"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.actors.evaluator import (
    BatchPlan,
    EpisodeSettings,
    Evaluator,
    OnTaskDone,
    sandbox_labels,
)
from engine.agents.binding import EvaluatorBinding
from engine.backends.pool import BackendPool
from engine.errors import LogError
from engine.events.base import Event
from engine.events.catalog import (
    AbortClass,
    BatchAdmitted,
    RolloutRequested,
    SampleAborted,
    TaskFetched,
    TokenReleased,
)
from engine.events.log import DeadEntry, EventLog
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.appender import GroupAppender
from engine.runtime.consumer import Delivery, GroupConsumer
from engine.runtime.rebuild import rebuild
from engine.sandbox.base import SandboxProvider

__all__ = ["BatchReport", "EvaluatorWorker", "WorkerConfig"]

logger = logging.getLogger(__name__)

GROUP = "evaluators"

# How far before a work entry's id the pool is scanned for the batch's releases: ids of
# different streams come from one clock, this only absorbs a clock step back.
_POOL_SCAN_MARGIN_MS = 60_000


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
    group: str = GROUP

    def __post_init__(self) -> None:
        if not self.evaluator_ids:
            raise ValueError("a worker needs at least one evaluator id")
        if self.max_batches < 1:
            raise ValueError(f"max_batches must be at least 1, got {self.max_batches}")


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What the ``on_batch_done`` callback hears when a batch is acked."""

    rollout_id: str
    batch_id: str
    evaluator_id: str
    ran: int
    completed: int
    aborted: int
    redelivered: bool


@dataclass(slots=True)
class _RolloutTasks:
    request: RolloutRequested | None = None
    tasks: dict[str, TaskFetched] = field(default_factory=dict)
    position: str = "0-0"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class EvaluatorWorker:
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        specs: Mapping[str, EvaluatorBinding],
        config: WorkerConfig,
        *,
        backends: BackendPool | None = None,
        sandbox_factory: SandboxProvider | None = None,
        on_task_done: OnTaskDone | None = None,
        on_batch_done: Callable[[BatchReport], None] | None = None,
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
        self._sandbox_factory = sandbox_factory
        self._on_task_done = on_task_done
        self._on_batch_done = on_batch_done
        self._settings = EpisodeSettings(
            worker_id=config.worker_id,
            tmp_root=config.tmp_root,
            cleanup_timeout_s=config.cleanup_timeout_s,
        )
        self._tasks: OrderedDict[str, _RolloutTasks] = OrderedDict()
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
        )
        self.batches_done = 0
        self.batches_handed_back = 0

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve batches until ``stop`` is set, then shut down as the module docstring says."""
        stop = stop or asyncio.Event()
        await self.consumer.start()
        active: dict[asyncio.Task[None], Delivery] = {}
        stop_wait = asyncio.get_running_loop().create_task(stop.wait())
        try:
            while not stop.is_set():
                free = self.config.max_batches - len(active)
                if free <= 0:
                    await asyncio.wait([*active, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                    self._reap_finished(active)
                    continue
                fetched = await self.consumer.fetch_or_stop(free, stop_wait)
                if fetched is None:
                    break
                deliveries, dead = fetched
                await self.consumer.handle_dead(dead, self._abort_dead)
                for d in deliveries:
                    task = asyncio.get_running_loop().create_task(self._run_delivery(d))
                    active[task] = d
                self._reap_finished(active)
            await self._shutdown(active)
        finally:
            stop_wait.cancel()
            await self.sink.aclose()
            await self.consumer.aclose()

    def _reap_finished(self, active: dict[asyncio.Task[None], Delivery]) -> None:
        for task in [t for t in active if t.done()]:
            d = active.pop(task)
            if task.cancelled():
                continue
            exc = task.exception()
            if exc is not None:
                logger.error(
                    "worker %s: batch entry %s failed, left pending for a retry: %r",
                    self.config.worker_id,
                    d.env.id,
                    exc,
                )
                self.consumer.release(d)

    async def _shutdown(self, active: dict[asyncio.Task[None], Delivery]) -> None:
        running = sum(1 for task in active if not task.done())
        handed: list[Delivery] = []
        if active:
            logger.info(
                "worker %s stopping: %d running batches get %.1f s to finish",
                self.config.worker_id,
                running,
                self.config.grace_s,
            )
            _done, pending = await asyncio.wait(list(active), timeout=self.config.grace_s)
            handed = [active[task] for task in pending]
            for task in pending:
                task.cancel()
            self.batches_handed_back += len(handed)
            await asyncio.gather(*pending, return_exceptions=True)
            self._reap_finished(active)
        with contextlib.suppress(LogError):
            await self.sink.flush()  # what finished is in Redis before anyone takes over
        await self.consumer.hand_back(handed)

    # ------------------------------------------------------------------ one batch

    async def _run_delivery(self, d: Delivery) -> None:
        ev = d.env.event
        if not isinstance(ev, BatchAdmitted):
            logger.warning("ignoring %s on work stream %s", ev.type, d.env.stream)
            await self.consumer.ack(d)
            return
        spec = self.specs.get(ev.evaluator_id)
        if spec is None:  # the stream names the id, so only a hand-written entry gets here
            logger.error("no evaluator %r for batch %s; leaving it", ev.evaluator_id, ev.batch_id)
            self.consumer.release(d)
            return
        plan = await (self._recovery_plan(d, ev) if d.redelivered else self._fresh_plan(d, ev))
        evaluator = Evaluator(
            spec,
            plan,
            sink=self.sink,
            names=self.names,
            settings=self._settings,
            backends=self._backends,
            sandbox_factory=self._sandbox_factory,
            on_task_done=self._on_task_done,
        )
        await evaluator.run()
        await self.sink.flush()
        await self.consumer.ack(d)
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
        cached = await self._rollout_tasks(ev.rollout_id, ev.sample_ids)
        return BatchPlan(
            admitted=ev,
            request=cached.request,
            tasks=cached.tasks,
            run_ids=tuple(ev.sample_ids),
            attempts={},
            tokens=tuple(ev.token_ids),
            causation=d.env.ref,
        )

    async def _recovery_plan(self, d: Delivery, ev: BatchAdmitted) -> BatchPlan:
        state = await self._fold(ev.rollout_id)
        run_ids = _not_terminal(state, ev.sample_ids)
        attempts = {
            sid: max(state.samples[sid].attempt, 0) + 1 for sid in run_ids if sid in state.samples
        }
        released, all_released = await self._released_tokens(d.env.id, ev)
        tokens = () if all_released else tuple(t for t in ev.token_ids if t not in released)
        if run_ids and ev.token_ids and not tokens:
            logger.warning(
                "batch %s: %d samples to re-run but every token was released; running ungated",
                ev.batch_id,
                len(run_ids),
            )
        await self._reap_previous(state, ev, run_ids)
        logger.info(
            "worker %s recovers batch %s (delivery %d): %d of %d samples to re-run, "
            "%d tokens held",
            self.config.worker_id,
            ev.batch_id,
            d.deliveries,
            len(run_ids),
            len(ev.sample_ids),
            len(tokens),
        )
        return BatchPlan(
            admitted=ev,
            request=state.request,
            tasks={sid: s.task for sid, s in state.samples.items()},
            run_ids=tuple(run_ids),
            attempts=attempts,
            tokens=tokens,
            causation=d.env.ref,
        )

    async def _fold(self, rollout_id: str) -> RolloutState:
        folded = await rebuild(self.log, self.names.rollout(rollout_id), RolloutProjection())
        return folded.state

    async def _released_tokens(self, entry_id: str, ev: BatchAdmitted) -> tuple[set[str], bool]:
        """Tokens of the batch already released on the pool (and whether all were)."""
        ms = int(entry_id.partition("-")[0])
        after = f"{max(ms - _POOL_SCAN_MARGIN_MS, 0)}-0"
        released: set[str] = set()
        for env in await self.log.read_all(self.names.pool, after=after):
            rel = env.event
            if (
                isinstance(rel, TokenReleased)
                and rel.rollout_id == ev.rollout_id
                and rel.batch_id == ev.batch_id
            ):
                if rel.token_ids is None:
                    return set(ev.token_ids), True
                released.update(rel.token_ids)
        return released, False

    async def _reap_previous(
        self, state: RolloutState, ev: BatchAdmitted, run_ids: Sequence[str]
    ) -> None:
        if self._sandbox_factory is None:
            return
        workers = sorted(
            {
                s.started.worker
                for sid in run_ids
                if (s := state.samples.get(sid)) is not None
                and s.started is not None
                and s.started.worker
            }
        )
        for worker in workers:
            selector = sandbox_labels(worker=worker, rollout_id=ev.rollout_id, batch_id=ev.batch_id)
            try:
                n = await self._sandbox_factory.reap(selector)
            except Exception as exc:  # reaping is best effort; the batch still runs
                logger.warning(
                    "reaping sandboxes of %s for %s failed: %s", worker, ev.batch_id, exc
                )
                continue
            logger.info("reaped %d sandboxes %s left for batch %s", n, worker, ev.batch_id)

    async def _rollout_tasks(self, rollout_id: str, needed: Sequence[str]) -> _RolloutTasks:
        cached = self._tasks.get(rollout_id)
        if cached is None:
            cached = self._tasks[rollout_id] = _RolloutTasks()
            while len(self._tasks) > self.config.task_cache_rollouts:
                self._tasks.popitem(last=False)
        else:
            self._tasks.move_to_end(rollout_id)
        async with cached.lock:
            missing = {sid for sid in needed if sid not in cached.tasks}
            stream = self.names.rollout(rollout_id)
            # Read on only until the batch's tasks are known: a batch can start while the
            # rest of a large plan is still unread (later batches read further).
            while missing:
                envs, position = await self.log.read_after(
                    stream, cached.position, block_ms=0, count=1000
                )
                for env in envs:
                    ev = env.event
                    if isinstance(ev, TaskFetched):
                        cached.tasks.setdefault(ev.sample_id, ev)
                        missing.discard(ev.sample_id)
                    elif isinstance(ev, RolloutRequested) and cached.request is None:
                        cached.request = ev
                if position == cached.position:
                    break
                cached.position = position
        return cached

    # ------------------------------------------------------------------ dead letters

    async def _abort_dead(self, entry: DeadEntry) -> None:
        ev = entry.event
        if not isinstance(ev, BatchAdmitted):
            return  # nothing it stood for can be aborted
        state = await self._fold(ev.rollout_id)
        run_ids = _not_terminal(state, ev.sample_ids)
        await self._reap_previous(state, ev, run_ids)
        stream = self.names.rollout(ev.rollout_id)
        causation = f"{entry.stream}@{entry.id}"
        items: list[tuple[str, Event]] = [
            (
                stream,
                SampleAborted(
                    rollout_id=ev.rollout_id,
                    sample_id=sid,
                    attempt=max(state.samples[sid].attempt, 1) if sid in state.samples else 1,
                    abort_class=AbortClass.INFRA_OTHER,
                    error=f"work entry {entry.id} dead-lettered: {entry.error}",
                    phase="delivery",
                    causation=causation,
                ),
            )
            for sid in run_ids
        ]
        released, all_released = await self._released_tokens(entry.id, ev)
        held = [] if all_released else [t for t in ev.token_ids if t not in released]
        if held:
            items.append(
                (
                    self.names.pool,
                    TokenReleased(
                        rollout_id=ev.rollout_id,
                        batch_id=ev.batch_id,
                        token_ids=held,
                        reason="dead_letter",
                        causation=causation,
                    ),
                )
            )
        self.sink.emit(items)
        await self.sink.flush()  # in Redis before the consumer settles (acks) the entry
        logger.warning(
            "batch %s dead-lettered after %d deliveries: %d samples aborted as infra_other",
            ev.batch_id,
            entry.deliveries,
            len(run_ids),
        )


def _not_terminal(state: RolloutState, sample_ids: Sequence[str]) -> list[str]:
    """Samples of the batch without a terminal event (unknown ids included: they abort)."""
    return [
        sid for sid in sample_ids if (s := state.samples.get(sid)) is None or not s.done
    ]
