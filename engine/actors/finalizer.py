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
  when ``out_dir`` or the dumps need them. Without the whole samples it reads the stream
  raw and folds the events most of it is made of (a sample's start, turns and end, a
  joined task) from their checked fields (``codec.decode_flat``) without building events;
  every other entry is decoded as a typed read decodes it, and one that does not decode is
  dead-lettered (once) by the log's own typed read, exactly as before -- then:

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
* The decisions are pure functions of the compact state (:func:`decide_ready`,
  :func:`decide_capture`, :func:`apply_filters`, ...), defined once in
  :mod:`engine.projections.decision` and re-exported here; they are tested directly, and
  the shell only reads, appends and acks.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.actors.artifacts import write_artifacts
from engine.actors.dumps import DumpConfig, write_dumps
from engine.actors.verify import VerifyTally
from engine.errors import AppendConflict, DecodeError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    CaptureRequested,
    RolloutFailed,
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
from engine.events.codec import decode, decode_flat
from engine.events.log import EMPTY_ID, DeadEntry, EventLog
from engine.projections.decision import (
    DecisionProjection,
    DecisionState,
    Selection,
    apply_filters,
    build_summary,
    carried_sources,
    decide_capture,
    decide_ready,
    groups_needed,
    ready_metrics,
    route,
    select_groups,
    stale_split,
    tail_aborts,
    tail_carried,
    version_spread,
    worth_deciding,
)
from engine.projections.rollout import (
    ControlProjection,
    RolloutProjection,
    RolloutState,
)
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer
from engine.runtime.live import LiveFold
from engine.runtime.loop import serve
from engine.runtime.retention import RetentionGroups, retention_pass

__all__ = [
    "Finalizer",
    "FinalizerConfig",
    "Selection",
    "RetentionConfig",
    "DecisionState",
    "apply_filters",
    "build_summary",
    "carried_sources",
    "decide_capture",
    "decide_ready",
    "groups_needed",
    "ready_metrics",
    "route",
    "select_groups",
    "stale_split",
    "tail_aborts",
    "tail_carried",
    "version_spread",
    "worth_deciding",
]

logger = logging.getLogger(__name__)

GROUP = "finalizers"
_READ_COUNT = 500  # entries a read of a rollout stream returns at most (read_after's)


# ---------------------------------------------------------------- pure decisions

# The decisions are pure functions of the compact fold, defined once in
# engine.projections.decision and re-exported here under the names the finalizer has
# always offered (one implementation: a change to a rule cannot diverge between copies).

# The lifecycle events of a carried sample copied from the stream it runs in.
_RELAYED = (SampleStarted, TurnCompleted, SampleCompleted, SampleAborted, TeacherScored)


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
        if self._whole is None:
            return await self._read_flat()
        # The finalizer following a rollout owns its stream: it dead-letters (once) what
        # does not decode there; every other reader skips such entries.
        envs, position = await self._log.read_after(
            self.stream, self.position, dead_letter=True
        )
        for env in envs:
            if self._fold(env):
                self.position = env.id
                return True
        self.position = position
        return bool(envs)

    def _fold(self, env: Envelope) -> bool:
        """Fold one decoded entry; returns whether the rollout is now decided."""
        if isinstance(env.event, SampleVerified):
            self.verify.add(env.event)
        self.state = self._projection.evolve(self.state, env)
        if self._whole is not None and self.full is not None:
            self.full = self._whole.evolve(self.full, env)
        return self.state.decided

    async def _read_flat(self) -> bool:
        """:meth:`read` for the compact fold alone. The entries come raw; those most of a
        stream is made of (a sample's start, turns and end, a joined task) are folded from
        their checked fields (``codec.decode_flat``) without building events, and
        every other entry is decoded as a typed read decodes it. An entry that does not
        decode is read again by the log's own typed read with ``dead_letter=True``, which
        dead-letters it (once) exactly as :meth:`EventLog.read_after` would have."""
        log, stream = self._log, self.stream
        if log.block_ms > 0:
            rows = [(i, raw) for _, i, raw in await log.tail_raw({stream: self.position})]
        else:  # read_after's non-blocking read (a tail_raw of 0 would block for ever)
            rows = await log.read_raw(stream, after=self.position, limit=_READ_COUNT)
        flat = self._projection.evolve_flat
        folded = False  # as read_after's envelopes: entries that decoded
        for entry_id, raw in rows:
            fields = decode_flat(raw)
            if fields is not None and flat(self.state, *fields):
                folded = True
                continue  # never a deciding event
            try:
                envs = [Envelope(stream, entry_id, decode(raw))]
            except DecodeError:
                envs = await log.read(stream, entry_id, entry_id, dead_letter=True)
            for env in envs:
                folded = True
                if self._fold(env):
                    self.position = entry_id
                    return True
        if rows:
            self.position = rows[-1][0]
        return folded


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
                    sources = carried_sources(f.state)
                    if sources:
                        relay = asyncio.create_task(self._relay(f.stream, sources))
                if f.state.capture is not None and not f.state.decided:
                    # asked for (maybe by a finalizer that died before its copy): make sure
                    # capture workers see it
                    await self._ensure_copy(f, self.names.capture, f.state.capture)
                failed = f.verify.failed(rollout_id) if not f.state.decided else None
                if failed is not None:  # a re-score past its threshold fails the rollout loudly
                    await self._append(f, [failed], (self.names.control, failed))
                elif not f.state.decided and worth_deciding(f.state):
                    await self._decide(f)
        finally:
            if relay is not None:
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
        if f.state.ready is not None:  # always a finalizer's; a RolloutFailed's writer copies it
            await self._ensure_copy(f, self.names.control, f.state.ready)
            carried = tail_carried(f.state, f.state.ready)
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
        capture = decide_capture(
            f.state, top_k=self.config.top_k, trainer_version=trainer_version
        )
        if capture is not None:
            if f.state.capture is None:  # asked once; then wait for its TeacherScored
                await self._append(f, [capture], (self.names.capture, capture))
            return
        ready = decide_ready(f.state, trainer_version)
        if ready is not None and f.verify.by_sample:
            ready = ready.model_copy(update={"metrics": {**ready.metrics, **f.verify.metrics()}})
        if ready is not None:
            # An aborted tail is recorded in the same step (after the RolloutReady, so the
            # artifacts -- folded up to the RolloutReady -- do not depend on it).
            events: list[Event] = [ready, *tail_aborts(f.state, ready)]
            also: list[tuple[str, _Copied]] = [(self.names.control, ready)]
            carried = tail_carried(f.state, ready)
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
