"""The finalizer: decides when a rollout is ready and appends ``RolloutReady``.

Contract
--------
* Input: ``RolloutRequested`` on ``rl:control`` through the consumer group ``finalizers``
  (several finalizers may run; each request is followed by one of them, and a crashed
  finalizer's requests are claimed by another after the idle window). The control entry is
  acked once the rollout has a ``RolloutReady`` or ``RolloutFailed``.
* Per rollout it folds ``rl:{rollout:<id>}`` with ``RolloutProjection`` using blocking reads
  (no sleep-polling) until every planned sample is terminal, then:

  1. applies the request's filters (rollout-engine §5): reward-based rejection first (drop
     every group whose samples' rewards are all equal -- an aborted sample counts as 0),
     then finish-only (keep samples whose episode ended with a clean ``finish``);
  2. when the request needs teacher logprobs (``teacher_capture``), asks for them once
     (``CaptureRequested`` for the kept completed samples, on ``rl:capture`` and, as the
     guard, on the rollout stream) and waits for their ``TeacherScored``;
  3. appends ``RolloutReady`` -- kept sample ids in training (index) order, dropped ids,
     counts and metrics; an empty result gives ``dummy=True`` (the trainer loads one masked
     dummy) -- to the rollout stream *with compare-and-append* and, in the same atomic
     step, to ``rl:control``. A conflict means someone appended meanwhile: refold and decide
     again. So there is only ever one ``RolloutReady``, with two finalizers or a restart.

* A request delivered more than the log's ``max_deliveries`` times (the finalizers following
  it kept dying or failing) is dead-lettered and its rollout gets ``RolloutFailed`` with
  the reason, by compare-and-append, unless it was decided meanwhile; the trainer's wait
  ends with that error instead of never. The entry is acked only after that.
* It runs on the actor runtime (``engine.runtime.loop.serve``): a stop hands the requests
  it follows back. Whether a decision is worth computing is read from the counters of
  ``RolloutProjection`` (terminal and scored samples, the ``CaptureRequested`` guard).
* At most ``max_rollouts`` rollouts are followed at once (each holds a connection in a
  blocking read); further requests wait in the group.
* The decisions are pure (:func:`decide_ready`, :func:`decide_capture`, :func:`apply_filters`)
  and tested directly; the shell only reads, appends and acks.
* With ``retention`` set, the finalizer also keeps Redis memory bounded on its own: every
  ``retention.every_s`` seconds it runs one retention pass
  (:func:`engine.runtime.retention.retention_pass`: acked shared-stream entries trimmed,
  finished rollouts past the window archived to the store, verified and deleted), so no
  operator command is needed. A pass that fails (Redis away) is logged and retried at the
  next tick; several finalizers may all run passes (archives are written atomically and
  verified before a delete).
* With ``out_dir`` set, the rollout's artifacts (``summary.json``, eval details, placement
  log, samples) are written to ``out_dir/<rollout id>/`` by
  :func:`engine.actors.artifacts.write_artifacts` from the state folded up to and
  including the ``RolloutReady`` -- the same function and the same events ``rollout replay``
  uses, so the bytes are identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.actors.artifacts import write_artifacts
from engine.agents.result import UNKNOWN_VERSION
from engine.domain import TerminationReason
from engine.errors import AppendConflict
from engine.events.catalog import (
    CaptureRequested,
    FilterSpec,
    RolloutFailed,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
    SampleCompleted,
)
from engine.events.log import EMPTY_ID, DeadEntry, EventLog
from engine.projections.rollout import RolloutProjection, RolloutState, SampleState
from engine.projections.summary import FailureClass, eval_metrics, sample_rows
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer
from engine.runtime.loop import serve
from engine.runtime.retention import RetentionGroups, retention_pass

__all__ = [
    "Finalizer",
    "FinalizerConfig",
    "RetentionConfig",
    "apply_filters",
    "decide_capture",
    "decide_ready",
    "ready_metrics",
    "worth_deciding",
]

logger = logging.getLogger(__name__)

GROUP = "finalizers"


# ---------------------------------------------------------------- pure decisions


def _reward(s: SampleState) -> float:
    done = s.completed
    return float(done.reward) if done is not None else 0.0


def apply_filters(state: RolloutState) -> tuple[list[str], list[str]]:
    """``(kept, dropped)`` sample ids in index order: rejection first, then finish-only."""
    filters = state.request.filters if state.request is not None else FilterSpec()
    ordered = state.ordered()
    kept = ordered
    if filters.reject_equal_rewards:
        rewards: dict[int, set[float]] = defaultdict(set)
        for s in ordered:
            rewards[s.task.group_index].add(_reward(s))
        kept = [s for s in kept if len(rewards[s.task.group_index]) > 1]
    if filters.finish_only:
        kept = [s for s in kept if s.completed is not None and _finished(s.completed)]
    kept_ids = {s.sample_id for s in kept}
    dropped = [s.sample_id for s in ordered if s.sample_id not in kept_ids]
    return [s.sample_id for s in kept], dropped


def _finished(done: SampleCompleted) -> bool:
    """A clean finish: the episode ended on the agent's own terms."""
    return done.termination_reason == TerminationReason.FINISH.value


def _needs_teacher(state: RolloutState) -> bool:
    return state.request is not None and state.request.teacher_capture


def _unscored(state: RolloutState, kept: list[str]) -> list[str]:
    """Kept completed samples still waiting for their teacher logprobs."""
    return [
        sid
        for sid in kept
        if (s := state.samples[sid]).completed is not None and s.teacher is None
    ]


def decide_capture(state: RolloutState, *, top_k: int = 20) -> CaptureRequested | None:
    """The teacher capture to ask for, once every sample is terminal (None: nothing to ask)."""
    if state.ready is not None or state.failed is not None or not _needs_teacher(state):
        return None
    if not state.all_terminal():
        return None
    kept, _ = apply_filters(state)
    missing = _unscored(state, kept)
    if not missing:
        return None
    assert state.rollout_id is not None
    return CaptureRequested(rollout_id=state.rollout_id, sample_ids=missing, top_k=top_k)


def ready_metrics(state: RolloutState, kept: list[str], dropped: list[str]) -> dict[str, float]:
    """Counts, reward statistics, failure-class counts and per-dataset eval metrics."""
    rows = sample_rows(state)
    n = len(rows)
    completed = [s.completed for s in state.samples.values() if s.completed is not None]
    out: dict[str, float] = {
        "n_samples": float(n),
        "n_kept": float(len(kept)),
        "n_dropped": float(len(dropped)),
        "n_completed": float(len(completed)),
        "n_aborted": float(n - len(completed)),
        "reward_mean": sum(r.reward for r in rows) / n if n else 0.0,
        "abort_rate": (n - len(completed)) / n if n else 0.0,
        "response_length_mean": (
            sum(len(c.response_ids) for c in completed) / len(completed) if completed else 0.0
        ),
    }
    for cls in FailureClass:
        out[f"class/{cls.value}"] = float(sum(1 for r in rows if r.failure_class is cls))
    kind = state.request.kind if state.request is not None else RolloutKind.TRAIN
    prefix = "eval" if kind is RolloutKind.EVAL else "rollout"
    out.update(eval_metrics(state, prefix=prefix, rows=rows))
    return out


def version_spread(state: RolloutState, kept: list[str]) -> dict[str, int]:
    """Sampled tokens (loss mask 1) of the kept completed samples per weight version, keyed
    as strings; tokens of samples recorded without versions count as unknown (``"-1"``)."""
    counts: Counter[int] = Counter()
    for sid in kept:
        sample = state.samples.get(sid)
        done = sample.completed if sample is not None else None
        if done is None:
            continue
        sampled = done.loss_mask.numpy().astype(bool)
        if not len(done.token_versions):
            counts[UNKNOWN_VERSION] += int(sampled.sum())
            continue
        values, n = np.unique(done.token_versions.numpy()[sampled], return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist(), strict=True)))
    return {str(v): counts[v] for v in sorted(counts)}


def decide_ready(state: RolloutState) -> RolloutReady | None:
    """The rollout's ``RolloutReady``, or None while it is not ready (or already decided).

    Ready means: the plan is complete, every sample is terminal, and -- when the request
    needs teacher logprobs -- every kept completed sample has its ``TeacherScored``.
    """
    if state.ready is not None or state.failed is not None or not state.all_terminal():
        return None
    kept, dropped = apply_filters(state)
    if _needs_teacher(state) and _unscored(state, kept):
        return None
    n_completed = sum(1 for s in state.samples.values() if s.completed is not None)
    request = state.request
    assert state.rollout_id is not None
    return RolloutReady(
        rollout_id=state.rollout_id,
        iteration=request.iteration if request is not None else 0,
        kind=request.kind if request is not None else RolloutKind.TRAIN,
        policy_version=request.policy_version if request is not None else 0,
        sample_ids=kept,
        dropped_sample_ids=dropped,
        dummy=not kept,
        n_completed=n_completed,
        n_aborted=len(state.samples) - n_completed,
        metrics=ready_metrics(state, kept, dropped),
        version_tokens=version_spread(state, kept),
    )


# ---------------------------------------------------------------- the shell


@dataclass(frozen=True, kw_only=True)
class RetentionConfig:
    """Retention run inside the finalizer (see the module docstring)."""

    store: Path
    keep_s: float
    groups: RetentionGroups
    every_s: float = 60.0

    def __post_init__(self) -> None:
        if self.keep_s < 0:
            raise ValueError(f"retention keep_s must be >= 0, got {self.keep_s}")
        if self.every_s <= 0:
            raise ValueError(f"retention every_s must be > 0, got {self.every_s}")


@dataclass(frozen=True, kw_only=True)
class FinalizerConfig:
    consumer: str
    out_dir: Path | None = None
    top_k: int = 20
    heartbeat_ms: int = 10_000
    claim_idle_ms: int = 60_000
    block_ms: int | None = None
    # Each followed rollout holds one connection in a blocking read; stay well under the
    # client's connection pool (RedisSettings.max_connections).
    max_rollouts: int = 32
    group: str = GROUP
    outage_limit_s: float | None = 300.0
    retention: RetentionConfig | None = None


Outcome = RolloutReady | RolloutFailed


def worth_deciding(state: RolloutState) -> bool:
    """A cheap test, from the fold's counters, that a decision may be due: every planned
    sample is terminal and, once a capture was asked for, as many samples are scored as
    it asked for. :func:`decide_capture` and :func:`decide_ready` then check in full."""
    planned = state.planned
    if planned is None or state.n_terminal < planned.n_samples:
        return False
    return state.capture is None or state.n_scored >= len(state.capture.sample_ids)


class _Follower:
    """One rollout stream folded with blocking reads (no sleep-polling)."""

    def __init__(self, log: EventLog, stream: str) -> None:
        self._log = log
        self.stream = stream
        self._projection = RolloutProjection()
        self.state = self._projection.initial()
        self.position = EMPTY_ID

    async def read(self) -> bool:
        """Fold what the next read returns (blocking when there is nothing yet); returns
        whether it read anything. Folding stops at the entry that decides the rollout, so
        ``position`` is then that entry (what replay folds up to)."""
        # The finalizer following a rollout owns its stream: it dead-letters (once) what
        # does not decode there; every other reader skips such entries.
        envs, position = await self._log.read_after(
            self.stream, self.position, dead_letter=True
        )
        for env in envs:
            self.state = self._projection.evolve(self.state, env)
            if self.state.decided:
                self.position = env.id
                return True
        self.position = position
        return bool(envs)


class Finalizer:
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        config: FinalizerConfig,
        *,
        on_ready: Callable[[RolloutReady], None] | None = None,
    ) -> None:
        self.log = log
        self.names = log.names
        self.config = config
        self._on_ready = on_ready
        self.consumer = GroupConsumer(
            log,
            group=config.group,
            consumer=config.consumer,
            streams=[self.names.control],
            heartbeat_ms=config.heartbeat_ms,
            claim_idle_ms=config.claim_idle_ms,
            block_ms=config.block_ms,
            ack_dead=False,  # settled once the rollout has its RolloutFailed
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self._following: set[str] = set()
        self.retention_passes = 0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Follow requested rollouts until ``stop``; unfinished ones are handed back."""
        stop = stop or asyncio.Event()
        keeper = (
            asyncio.create_task(self._retain(self.config.retention, stop), name="retention")
            if self.config.retention is not None
            else None
        )
        try:
            await serve(
                self.consumer,
                stop,
                self._serve,
                on_dead=self._fail_dead,
                capacity=self.config.max_rollouts,
            )
        finally:
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper

    async def _retain(self, retention: RetentionConfig, stop: asyncio.Event) -> None:
        """One retention pass every ``retention.every_s`` seconds until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=retention.every_s)
            if stop.is_set():
                return
            try:
                report = await retention_pass(
                    self.log, retention.store, keep_s=retention.keep_s, groups=retention.groups
                )
            except Exception as exc:  # Redis away, a full disk: try again next tick
                logger.warning("retention pass failed: %s", exc)
                continue
            self.retention_passes += 1
            if report.archived or report.conflicts or any(report.trimmed.values()):
                logger.info("retention: %s", report.summary())

    async def _serve(self, d: Delivery) -> None:
        ev = d.env.event
        if not isinstance(ev, RolloutRequested):
            return  # ready/failed/policy events are not ours to act on: acked
        if ev.rollout_id in self._following:
            return  # a duplicate request: one follower is enough
        self._following.add(ev.rollout_id)
        try:
            await self.follow(ev.rollout_id)
        finally:
            self._following.discard(ev.rollout_id)

    async def _fail_dead(self, entry: DeadEntry) -> None:
        """A request handed out more than ``max_deliveries`` times (its finalizers kept
        dying or failing on it) fails its rollout, so the trainer waiting for it gets an
        error naming why instead of waiting forever. A rollout decided meanwhile keeps its
        outcome. The consumer settles (acks) the entry once this has returned."""
        ev = entry.event
        if not isinstance(ev, RolloutRequested) or ev.rollout_id in self._following:
            return
        f = _Follower(self.log, self.names.rollout(ev.rollout_id))
        failed = RolloutFailed(
            rollout_id=ev.rollout_id,
            reason=f"finalizing gave up: request {entry.stream}@{entry.id} {entry.error}",
            causation=f"{entry.stream}@{entry.id}",
        )
        while not f.state.decided:
            if await f.read():
                continue  # caught up only once a read returns nothing
            try:
                await self.log.append_if_last(
                    f.stream, failed, f.position, also=[(self.names.control, failed)]
                )
            except AppendConflict:
                continue  # something was appended: fold it and look again
            logger.error("rollout %s failed: %s", ev.rollout_id, failed.reason)
            return

    async def follow(self, rollout_id: str) -> Outcome:
        """Fold the rollout until it is decided, deciding it when it is ready."""
        f = _Follower(self.log, self.names.rollout(rollout_id))
        while not f.state.decided:
            await f.read()
            if not f.state.decided and worth_deciding(f.state):
                await self._decide(f)
        return self._finish(rollout_id, f.state)

    async def _decide(self, f: _Follower) -> None:
        capture = decide_capture(f.state, top_k=self.config.top_k)
        if capture is not None:
            if f.state.capture is None:  # asked once; then wait for its TeacherScored
                await self._append(f, capture, (self.names.capture, capture))
            return
        ready = decide_ready(f.state)
        if ready is not None:
            await self._append(f, ready, (self.names.control, ready))

    async def _append(
        self,
        f: _Follower,
        event: CaptureRequested | RolloutReady,
        also: tuple[str, CaptureRequested | RolloutReady],
    ) -> None:
        try:
            await self.log.append_if_last(f.stream, event, f.position, also=[also])
        except AppendConflict:
            # Someone appended meanwhile (a late event, another finalizer): the next read
            # picks it up and the decision is taken again on the newer state.
            logger.debug("finalizer: %s on %s lost a race; refolding", event.type, f.stream)

    def _finish(self, rollout_id: str, state: RolloutState) -> Outcome:
        if state.ready is not None:
            if self.config.out_dir is not None:
                write_artifacts(state, self.config.out_dir / rollout_id)
            logger.info(
                "rollout %s ready: %d kept, %d dropped%s",
                rollout_id,
                len(state.ready.sample_ids),
                len(state.ready.dropped_sample_ids),
                " (dummy)" if state.ready.dummy else "",
            )
            if self._on_ready is not None:
                self._on_ready(state.ready)
            return state.ready
        assert state.failed is not None
        logger.warning("rollout %s failed: %s", rollout_id, state.failed.reason)
        return state.failed
