"""The finalizer: decides when a rollout is ready and appends ``RolloutReady``.

Contract
--------
* Input: ``RolloutRequested`` on ``rl:control`` through the consumer group ``finalizers``
  (several finalizers may run; each request is followed by one of them, and a crashed
  finalizer's requests are claimed by another after the idle window). The control entry is
  acked once the rollout has a ``RolloutReady`` or ``RolloutFailed``.
* Per rollout it folds ``rl:{rollout:<id>}`` using blocking reads (no sleep-polling) until
  every planned sample is terminal -- into the compact state of
  :mod:`engine.projections.decision` (a few hundred bytes a sample: outcome, reward, group,
  attempt, token counts per weight version, ...), not the samples themselves, so a
  1M-sample rollout fits a finalizer's memory; the whole samples are folded beside it only
  when ``out_dir`` or the dumps need them -- then:

  1. applies the request's filters (rollout-engine §5): reward-based rejection first (drop
     every group whose samples' rewards are all equal -- an aborted sample counts as 0),
     then finish-only (keep samples whose episode ended with a clean ``finish``);
  2. routes by the request's ``algorithm`` (``engine.projections.lanes``): when the lane
     needs teacher logprobs (the per-token lanes, or ``teacher_capture``), asks for them once
     (``CaptureRequested`` for the kept completed samples, on ``rl:capture`` and, as the
     guard, on the rollout stream) and waits for their ``TeacherScored``; the CE-only lane
     drops the trajectories with an over-long SFT sub-sample whole and sets ``gbs_scale``;
  3. appends ``RolloutReady`` -- kept sample ids in training (index) order, dropped ids,
     counts and metrics; an empty result gives ``dummy=True`` (the trainer loads one masked
     dummy) -- to the rollout stream *with compare-and-append*, then a copy to
     ``rl:control``. A conflict means someone appended meanwhile: refold and decide
     again. So there is only ever one ``RolloutReady`` on the rollout stream, with two
     finalizers or a restart. The copy is a second step (the rollout stream and the
     control plane live on different cluster slots), made with ``append_once`` keyed by
     the event type and rollout id, and made again by every finalizer that finds the
     rollout decided: a crash between the steps loses no copy and racing finalizers
     write one. ``CaptureRequested`` is copied to ``rl:capture`` the same way.

* A request delivered more than the log's ``max_deliveries`` times (the finalizers following
  it kept dying or failing) is dead-lettered and its rollout gets ``RolloutFailed`` with
  the reason, by compare-and-append, unless it was decided meanwhile; the trainer's wait
  ends with that error instead of never. The entry is acked only after that.
* It runs on the actor runtime (``engine.runtime.loop.serve``): a stop hands the requests
  it follows back. Whether a decision is worth computing is read from the fold's counters
  (terminal and scored samples, the ``CaptureRequested`` guard).
* At most ``max_rollouts`` rollouts are followed at once (each holds a connection in a
  blocking read); further requests wait in the group.
* The decisions are pure (:func:`decide_ready`, :func:`decide_capture`, :func:`apply_filters`
  here, from the full :class:`RolloutState`; the same names in
  :mod:`engine.projections.decision`, from the compact state the shell folds) and tested
  directly, one against the other; the shell only reads, appends and acks.
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
from engine.actors.dumps import DumpConfig, write_dumps
from engine.actors.verify import VerifyTally
from engine.agents.result import UNKNOWN_VERSION
from engine.domain import TerminationReason
from engine.errors import AppendConflict
from engine.events.base import Event
from engine.events.catalog import (
    AbortClass,
    CaptureRequested,
    FilterSpec,
    RolloutFailed,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    SampleVerified,
    TailCarried,
    TeacherScored,
    TurnCompleted,
)
from engine.events.log import EMPTY_ID, DeadEntry, EventLog
from engine.projections import decision as compact
from engine.projections.decision import DecisionProjection, DecisionState
from engine.projections.lanes import needs_teacher, route
from engine.projections.rollout import (
    ControlProjection,
    RolloutProjection,
    RolloutState,
    SampleState,
    staleness_floor,
)
from engine.projections.rows import row_of
from engine.projections.summary import FailureClass, eval_metrics
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer
from engine.runtime.live import LiveFold
from engine.runtime.loop import serve
from engine.runtime.retention import RetentionGroups, retention_pass

__all__ = [
    "Finalizer",
    "FinalizerConfig",
    "Selection",
    "RetentionConfig",
    "apply_filters",
    "carried_sources",
    "decide_capture",
    "decide_ready",
    "groups_needed",
    "ready_metrics",
    "select_groups",
    "stale_split",
    "tail_aborts",
    "tail_carried",
    "worth_deciding",
]

logger = logging.getLogger(__name__)

GROUP = "finalizers"


# ---------------------------------------------------------------- pure decisions


def _reward(s: SampleState) -> float:
    done = s.completed
    return float(done.reward) if done is not None else 0.0


def apply_filters(
    state: RolloutState, samples: list[SampleState] | None = None
) -> tuple[list[str], list[str]]:
    """``(kept, dropped)`` sample ids in index order: rejection first, then finish-only.
    ``samples`` (index order) restricts the decision to those; default: every sample."""
    filters = state.request.filters if state.request is not None else FilterSpec()
    ordered = state.ordered() if samples is None else samples
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
    return needs_teacher(state.request)  # routed by the request's algorithm (lanes)


def _unscored(state: RolloutState, kept: list[str]) -> list[str]:
    """Kept completed samples still waiting for their teacher logprobs."""
    return [
        sid
        for sid in kept
        if (s := state.samples[sid]).completed is not None and s.teacher is None
    ]


def groups_needed(state: RolloutState) -> int | None:
    """Whole groups an over-provisioned training rollout becomes ready with (its request's
    ``n_prompts``); None: the rollout waits for every planned sample."""
    request = state.request
    if request is None or request.kind is not RolloutKind.TRAIN:
        return None
    if request.n_planned_prompts <= request.n_prompts:
        return None
    return request.n_prompts


@dataclass(frozen=True, slots=True)
class Selection:
    """The groups a ready rollout is made of: their samples (index order) and the tail --
    the other samples of an over-provisioned rollout (index order)."""

    samples: list[SampleState]
    tail: list[str]


def select_groups(state: RolloutState) -> Selection | None:
    """The rollout's groups once it may become ready (None: not yet).

    Without over-provisioning that is every sample, once every planned sample is terminal.
    With it, the first ``n_prompts`` groups to become whole (every sample terminal), in the
    order the log made them whole -- a pure function of the rollout stream, so a replay
    selects the same groups; every other sample is the tail."""
    planned = state.planned
    if planned is None or len(state.samples) < planned.n_samples:
        return None
    need = groups_needed(state)
    if need is None or need >= len(state.group_size):
        if not state.all_terminal():
            return None
        return Selection(state.ordered(), [])
    if len(state.completed_groups) < need:
        return None
    chosen = set(state.completed_groups[:need])
    ordered = state.ordered()
    return Selection(
        [s for s in ordered if s.task.group_index in chosen],
        [s.sample_id for s in ordered if s.task.group_index not in chosen],
    )


def _sampled_versions(done: SampleCompleted) -> np.ndarray:
    """The weight version of each sampled (loss-masked) token; -1 where unknown."""
    sampled = done.loss_mask.numpy().astype(bool)
    if not len(done.token_versions):
        return np.full(int(sampled.sum()), UNKNOWN_VERSION, dtype=np.int64)
    versions: np.ndarray = done.token_versions.numpy()[sampled].astype(np.int64)
    return versions


def stale_split(
    samples: list[SampleState], floor: int | None
) -> tuple[list[SampleState], list[SampleState], int]:
    """``(fresh, stale, stale_tokens)``: the samples that meet the staleness bound
    ``floor`` and those that do not, with the stale ones' sampled tokens.

    A completed sample is stale when any sampled token comes from a version older than
    ``floor`` or from an unknown version (:func:`version_meets`); a sample the worker ended
    as ``stale`` (it could no longer meet the bound) is stale too. Observation tokens are
    not sampled and never count. Without a bound every sample is fresh."""
    if floor is None:
        return samples, [], 0
    fresh: list[SampleState] = []
    stale: list[SampleState] = []
    tokens = 0
    for s in samples:
        aborted = s.aborted
        if aborted is not None:
            (stale if aborted.abort_class is AbortClass.STALE else fresh).append(s)
            continue
        done = s.completed
        if done is None:
            fresh.append(s)
            continue
        versions = _sampled_versions(done)
        bad = (versions < 0) | (versions < floor)
        if bad.any():
            stale.append(s)
            tokens += len(versions)
        else:
            fresh.append(s)
    return fresh, stale, tokens


def decide_capture(
    state: RolloutState, *, top_k: int = 20, trainer_version: int | None = None
) -> CaptureRequested | None:
    """The teacher capture to ask for, once the rollout's groups are terminal (None: nothing
    to ask)."""
    if state.ready is not None or state.failed is not None or not _needs_teacher(state):
        return None
    selection = select_groups(state)
    if selection is None:
        return None
    fresh, _, _ = stale_split(selection.samples, staleness_floor(state.request, trainer_version))
    kept, _ = apply_filters(state, fresh)
    missing = _unscored(state, kept)
    if not missing:
        return None
    assert state.rollout_id is not None
    return CaptureRequested(rollout_id=state.rollout_id, sample_ids=missing, top_k=top_k)


def ready_metrics(
    state: RolloutState,
    kept: list[str],
    dropped: list[str],
    samples: list[SampleState] | None = None,
) -> dict[str, float]:
    """Counts, reward statistics, failure-class counts and per-dataset eval metrics of
    ``samples`` (default: every sample; a partial rollout passes its selected groups')."""
    chosen = state.ordered() if samples is None else samples
    rows = [row_of(s) for s in chosen]
    n = len(rows)
    completed = [s.completed for s in chosen if s.completed is not None]
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
        count = sum(1 for r in rows if r.failure_class is cls)
        if count or not cls.engine_ended:  # the engine's own classes only when present
            out[f"class/{cls.value}"] = float(count)
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
        values, n = np.unique(_sampled_versions(done), return_counts=True)
        counts.update(dict(zip(values.tolist(), n.tolist(), strict=True)))
    return {str(v): counts[v] for v in sorted(counts)}


def decide_ready(state: RolloutState, trainer_version: int | None = None) -> RolloutReady | None:
    """The rollout's ``RolloutReady``, or None while it is not ready (or already decided).

    Ready means: the plan is complete, the rollout's groups are terminal (every sample, or
    the first ``n_prompts`` whole groups of an over-provisioned rollout:
    :func:`select_groups`), and -- when the request needs teacher logprobs -- every kept
    completed sample has its ``TeacherScored``. ``trainer_version`` is the highest
    ``PolicyVersionPublished`` version the finalizer has read (None: none); with the
    request's ``max_staleness`` it fixes the bound (:func:`stale_split`). The decision is a
    pure function of the folded stream and ``trainer_version``, and the ``RolloutReady``
    records the version it used, so it can be re-derived from the log.
    """
    if state.ready is not None or state.failed is not None:
        return None
    selection = select_groups(state)
    if selection is None:
        return None
    request = state.request
    floor = staleness_floor(request, trainer_version)
    fresh, stale, stale_tokens = stale_split(selection.samples, floor)
    kept, dropped = apply_filters(state, fresh)
    if _needs_teacher(state) and _unscored(state, kept):
        return None
    routed = route(state, kept, dropped)  # route -> shape (engine.projections.lanes)
    kept, dropped = routed.kept, routed.dropped
    chosen = selection.samples
    n_completed = sum(1 for s in chosen if s.completed is not None)
    metrics = {**ready_metrics(state, kept, dropped, chosen), **(routed.metrics or {})}
    current = None
    if floor is not None:
        assert request is not None and request.max_staleness is not None
        current = floor + request.max_staleness
        metrics["n_stale"] = float(len(stale))
        metrics["stale_tokens"] = float(stale_tokens)
    if selection.tail:
        metrics["n_tail"] = float(len(selection.tail))
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
        n_aborted=len(chosen) - n_completed,
        metrics=metrics,
        version_tokens=version_spread(state, kept),
        gbs_scale=routed.gbs_scale,
        trainer_version=current,
        stale_sample_ids=[s.sample_id for s in stale],
        stale_tokens=stale_tokens,
        tail_sample_ids=selection.tail,
        tail_carried=bool(selection.tail) and request is not None and request.tail == "carry",
    )


_RELAYED = (SampleStarted, TurnCompleted, SampleCompleted, SampleAborted, TeacherScored)


def carried_sources(state: RolloutState | DecisionState) -> dict[str, set[str]]:
    """Per rollout a carried sample runs in, the ids of this rollout's carried samples.
    From the compact state (the finalizer's) it is kept as the tasks are folded; from the
    full state it is a scan of every sample."""
    if isinstance(state, DecisionState):
        return compact.carried_sources(state)
    out: dict[str, set[str]] = defaultdict(set)
    for s in state.samples.values():
        if s.task.carried_from is not None:
            out[s.task.carried_from].add(s.sample_id)
    return dict(out)


def tail_carried(state: RolloutState, ready: RolloutReady) -> TailCarried | None:
    """The ``TailCarried`` (for ``rl:data``) of a rollout ready with a carried tail."""
    request = state.request
    if not ready.tail_carried or request is None or request.request_stream is None:
        return None
    return TailCarried(
        rollout_id=ready.rollout_id,
        request_stream=request.request_stream,
        tasks=[state.samples[sid].task for sid in ready.tail_sample_ids],
    )


def tail_aborts(state: RolloutState, ready: RolloutReady) -> list[SampleAborted]:
    """The ``SampleAborted`` (``tail_aborted``) of every tail sample still without a
    terminal event, for a request whose tail is aborted; appended with the
    ``RolloutReady`` in one step (index order)."""
    if not ready.tail_sample_ids or ready.tail_carried:
        return []
    out: list[SampleAborted] = []
    for sid in ready.tail_sample_ids:
        s = state.samples[sid]
        if s.done:
            continue
        out.append(
            SampleAborted(
                rollout_id=ready.rollout_id,
                sample_id=sid,
                attempt=max(s.attempt, 0),
                abort_class=AbortClass.TAIL_ABORTED,
                error=(
                    "tail of an over-provisioned rollout: it became ready with "
                    f"{len(ready.sample_ids) + len(ready.dropped_sample_ids)} samples of its "
                    "first whole groups"
                ),
                turns=len(s.turns),
            )
        )
    return out


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
    dumps: DumpConfig | None = None  # analysis dumps, best-effort (engine.actors.dumps)
    group: str = GROUP
    outage_limit_s: float | None = 300.0
    retention: RetentionConfig | None = None


Outcome = RolloutReady | RolloutFailed
_Copied = Outcome | CaptureRequested | TailCarried  # what a finalizer copies to the plane


def worth_deciding(state: RolloutState) -> bool:
    """A cheap test, from the fold's counters, that a decision may be due: every planned
    sample is terminal (an over-provisioned rollout: enough groups are whole) and, once a
    capture was asked for, as many samples are scored as it asked for.
    :func:`decide_capture` and :func:`decide_ready` then check in full."""
    planned = state.planned
    if planned is None:
        return False
    need = groups_needed(state)
    if need is not None and len(state.samples) >= planned.n_samples:
        if len(state.completed_groups) < need:
            return False
    elif state.n_terminal < planned.n_samples:
        return False
    return state.capture is None or state.n_scored >= len(state.capture.sample_ids)


class _Follower:
    """One rollout stream folded with blocking reads (no sleep-polling), into the compact
    state the decisions need (:mod:`engine.projections.decision`): a few hundred bytes a
    sample, not the samples themselves."""

    def __init__(self, log: EventLog, stream: str, *, whole: bool = False) -> None:
        self._log = log
        self.stream = stream
        self._projection = DecisionProjection()
        self.state = self._projection.initial()
        # The whole samples, folded beside the compact state only when the artifacts or
        # dumps are written (they are built from the samples themselves).
        self._whole = RolloutProjection() if whole else None
        self.full: RolloutState | None = self._whole.initial() if self._whole else None
        self.verify = VerifyTally()  # the rollout's SampleVerified (actors/verify.py)
        self.position = EMPTY_ID
        self.copied: set[str] = set()  # event types this follower has copied itself

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
            if isinstance(env.event, SampleVerified):
                self.verify.add(env.event)
            self.state = self._projection.evolve(self.state, env)
            if self._whole is not None and self.full is not None:
                self.full = self._whole.evolve(self.full, env)
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
        # rl:control as far as staleness bounds need it (the trainer's current version).
        self._control = LiveFold(log, self.names.control, ControlProjection())
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
                await self.log.append_if_last(f.stream, failed, f.position)
            except AppendConflict:
                continue  # something was appended: fold it and look again
            logger.error("rollout %s failed: %s", ev.rollout_id, failed.reason)
            await self._ensure_copy(f, self.names.control, failed)
            return
        if f.state.failed is not None and f.state.failed.causation == failed.causation:
            # this very step ran before and died before its copy
            await self._ensure_copy(f, self.names.control, f.state.failed)

    async def follow(self, rollout_id: str) -> Outcome:
        """Fold the rollout until it is decided, deciding it when it is ready."""
        dumps = self.config.dumps
        whole = self.config.out_dir is not None or (dumps is not None and dumps.armed)
        f = _Follower(self.log, self.names.rollout(rollout_id), whole=whole)
        relay: asyncio.Task[None] | None = None
        try:
            while not f.state.decided:
                await f.read()
                if relay is None and f.state.planned is not None:
                    sources = compact.carried_sources(f.state)
                    if sources:
                        relay = asyncio.create_task(self._relay(f.stream, sources))
                if f.state.capture is not None and not f.state.decided:
                    # asked for (maybe by a finalizer that died before its copy): make sure
                    # capture workers see it
                    await self._ensure_copy(f, self.names.capture, f.state.capture)
                failed = f.verify.failed(rollout_id) if not f.state.decided else None
                if failed is not None:  # a re-score past its threshold fails the rollout loudly
                    await self._append(f, [failed], (self.names.control, failed))
                elif not f.state.decided and compact.worth_deciding(f.state):
                    await self._decide(f)
        finally:
            if relay is not None:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
        if f.state.ready is not None:  # always a finalizer's; a RolloutFailed's writer copies it
            await self._ensure_copy(f, self.names.control, f.state.ready)
            carried = compact.tail_carried(f.state, f.state.ready)
            if carried is not None:  # the next request of the stream takes it over
                await self._ensure_copy(f, self.names.data, carried)
        elif f.state.failed is not None and f.state.failed == f.verify.failed(rollout_id):
            await self._ensure_copy(f, self.names.control, f.state.failed)  # ours, as above
        return self._finish(rollout_id, f)

    async def _ensure_copy(
        self, f: _Follower, stream: str, event: _Copied
    ) -> None:
        """Copy ``event`` to ``stream`` once, whoever tries (module doc, step 3)."""
        if event.type in f.copied:
            return
        marker = self.names.once(f"{event.type}.{event.rollout_id}")
        await self.log.append_once(stream, event, marker)
        f.copied.add(event.type)

    async def _relay(self, stream: str, sources: dict[str, set[str]]) -> None:
        """Copy the lifecycle events of carried samples from the streams of the rollouts
        they run in into this rollout's stream, as they come (a tail carried over keeps
        running there), so this rollout's stream alone decides it and replays it. A copy
        written twice (a restart) is a duplicate the fold ignores."""
        positions = {self.names.rollout(src): EMPTY_ID for src in sources}
        wanted = {self.names.rollout(src): ids for src, ids in sources.items()}
        while True:
            envs = await self.log.tail(positions)
            copies: list[tuple[str, Event]] = []
            for env in envs:
                positions[env.stream] = env.id
                ev = env.event
                if isinstance(ev, _RELAYED) and ev.sample_id in wanted.get(env.stream, ()):
                    copies.append((stream, ev))
            if copies:
                await self.log.append_many(copies)

    async def _trainer_version(self, state: DecisionState) -> int | None:
        """The highest version published on ``rl:control`` so far, read only for a request
        with a staleness bound (the only decision it changes)."""
        request = state.request
        if request is None or request.max_staleness is None:
            return None
        await self._control.refresh()
        return self._control.state.published

    async def _decide(self, f: _Follower) -> None:
        trainer_version = await self._trainer_version(f.state)
        capture = compact.decide_capture(
            f.state, top_k=self.config.top_k, trainer_version=trainer_version
        )
        if capture is not None:
            if f.state.capture is None:  # asked once; then wait for its TeacherScored
                await self._append(f, [capture], (self.names.capture, capture))
            return
        ready = compact.decide_ready(f.state, trainer_version)
        if ready is not None and f.verify.by_sample:
            ready = ready.model_copy(update={"metrics": {**ready.metrics, **f.verify.metrics()}})
        if ready is not None:
            # An aborted tail is recorded in the same step (after the RolloutReady, so the
            # artifacts -- folded up to the RolloutReady -- do not depend on it).
            events: list[Event] = [ready, *compact.tail_aborts(f.state, ready)]
            also: list[tuple[str, _Copied]] = [(self.names.control, ready)]
            carried = compact.tail_carried(f.state, ready)
            if carried is not None:  # the next request of the stream takes it over
                also.append((self.names.data, carried))
            await self._append(f, events, *also)

    async def _append(
        self, f: _Follower, events: list[Event], *also: tuple[str, _Copied]
    ) -> None:
        event = events[0]
        try:
            await self.log.append_if_last(f.stream, events, f.position)
        except AppendConflict:
            # Someone appended meanwhile (a late event, another finalizer): the next read
            # picks it up and the decision is taken again on the newer state.
            logger.debug("finalizer: %s on %s lost a race; refolding", event.type, f.stream)
            return
        for stream, copy in also:  # other slots: copied once each, after the decision
            await self._ensure_copy(f, stream, copy)

    def _finish(self, rollout_id: str, f: _Follower) -> Outcome:
        state = f.state
        if state.ready is not None:
            if f.full is not None:  # folded up to and including the RolloutReady
                if self.config.out_dir is not None:
                    write_artifacts(f.full, self.config.out_dir / rollout_id)
                if self.config.dumps is not None:
                    write_dumps(f.full, self.config.dumps)  # never raises: best-effort
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
