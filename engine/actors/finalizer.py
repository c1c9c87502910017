"""The finalizer: decides when a rollout is ready and appends ``RolloutReady``.

Contract
--------
* Input: ``RolloutRequested`` on ``rl:control`` through the consumer group ``finalizers``
  (one finalizer follows each request; a crashed finalizer's requests are claimed by
  another after the idle window). The entry is acked once the rollout has its
  ``RolloutReady`` or ``RolloutFailed``. At most ``max_rollouts`` are followed at once.
* Per rollout it folds ``rl:{rollout:<id>}`` with blocking reads into the rollout fold
  (:mod:`engine.projections.rollout`: a record of a few hundred bytes a sample, so a
  1M-sample rollout fits its memory). It owns the stream: an entry that does not decode
  is dead-lettered (once) by its typed read. Whether deciding is worth it is read off the
  fold's counters; the decisions are pure functions of the records
  (:mod:`engine.projections.decision`, re-exported here):

  1. the request's filters: reward-based rejection (drop every group whose rewards are
     all equal; an abort counts as 0), then finish-only (a clean ``finish``);
  2. the lane (``engine.projections.lanes``): a lane that needs teacher logprobs asks for
     them once (``CaptureRequested`` on the rollout stream, as the guard, and copied to
     ``rl:capture``) and waits for their ``TeacherScored``; the CE lane drops
     trajectories with an over-long sub-sample whole and sets ``gbs_scale``;
  3. ``RolloutReady`` (kept ids in training order, dropped ids, counts and metrics;
     ``dummy=True`` when nothing is kept), with an aborted tail's ``SampleAborted``, is
     appended to the rollout stream *with compare-and-append*: a conflict means someone
     appended meanwhile, so it refolds and decides again, and the stream holds one
     ``RolloutReady`` whatever runs. Once it is folded, the artifacts are written
     (``out_dir``), then it is copied to ``rl:control`` (a carried tail's
     ``TailCarried``, its tasks read back, to ``rl:data``) with ``append_once``: the
     streams live on different cluster slots, every finalizer that finds the rollout
     decided makes the copies again, and each lands once.

* A request delivered more than ``max_deliveries`` times fails its rollout
  (``RolloutFailed`` by compare-and-append, unless it was decided meanwhile), so the
  trainer's wait ends with the reason; the entry is acked only after that.
* With ``out_dir``, the artifacts (:func:`engine.actors.artifacts.write_artifacts`) are
  built from the fold up to and including the ``RolloutReady`` and its records' entries
  read back -- what ``rollout replay`` builds them from, so the bytes are identical. The
  dumps take the same samples.
* With ``stall_window_s``, a rollout whose stream gets no new entry for that long gets a
  ``RolloutStalled`` naming what it waits for (:mod:`engine.actors.stall`), again every
  window while it stays stalled.
* With ``retention`` (the process's default), every ``retention.every_s`` seconds it runs a
  retention pass (:func:`engine.runtime.retention.retention_pass`: acked entries trimmed,
  finished rollouts archived, verified and deleted, the pool and the data cursor trimmed
  below their snapshots, dead letters trimmed); a failed pass is retried at the next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from engine.actors.artifacts import write_artifacts
from engine.actors.dumps import DumpConfig, write_dumps
from engine.actors.stall import StallWatch
from engine.actors.verify import VerifyTally
from engine.errors import AppendConflict, DecodeError, LogError
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
from engine.events.codec import decode
from engine.events.fastpath import checked
from engine.events.log import DeadEntry, EventLog
from engine.events.log_base import gc_paused
from engine.projections.base import Folded
from engine.projections.control import ControlProjection
from engine.projections.decision import (
    Selection,
    apply_filters,
    carried_sources,
    carries_tail,
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
from engine.projections.readback import Rollout
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.projections.summary import artifact_entries
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer, ride_out
from engine.runtime.follower import Follower
from engine.runtime.loop import serve
from engine.runtime.readback import read_entries, read_tasks
from engine.runtime.retention import DEAD_MAX, RetentionGroups, retention_pass

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
_READ_COUNT = 500  # entries per read of a followed rollout stream

# The decisions are pure functions of the fold, defined in engine.projections.decision and
# re-exported here.

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
    dead_max: int = DEAD_MAX

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
    stall_window_s: float | None = None  # None: no stall diagnostics (engine.actors.stall)


Outcome = RolloutReady | RolloutFailed
_Copied = Outcome | CaptureRequested | TailCarried  # what a finalizer copies to the plane


class _Rollout(Follower[RolloutState]):
    """One rollout stream folded with blocking reads (no sleep-polling) into the rollout
    fold's records (a few hundred bytes a sample, not the samples themselves), up to the
    entry that decides the rollout: ``position`` is then that entry (what replay folds up
    to). The finalizer following a rollout owns its stream: it dead-letters (once) what does
    not decode there; every other reader skips such entries."""

    def __init__(
        self, log: EventLog, stream: str, *, block_ms: int | None, backoff: Backoff
    ) -> None:
        self._fold = RolloutProjection()
        super().__init__(
            log, stream, self._fold, owner=True, block_ms=block_ms, backoff=backoff,
            until=_decided,
        )
        self.verify = VerifyTally()  # the rollout's SampleVerified (actors/verify.py)
        self.copied: set[str] = set()  # event types this follower has copied itself
        self.rollout: Rollout | None = None  # the samples' entries, once read back

    async def _fetch(self, block_ms: int) -> list[Envelope]:
        """One read past the position, folded: the entries a stream is mostly made of are
        folded from their checked fields (``fastpath.checked``) without building their
        events; every other entry is decoded and folded as a typed read would, and only
        those are returned. One that does not decode is read again by the log's typed read
        with ``dead_letter=True``, which dead-letters it (once) as ``read_after`` would."""
        log, stream, fold = self.log, self.stream, self._fold
        rows = await log.tail_raw({stream: self.position}, block_ms=block_ms, count=_READ_COUNT)
        self.caught_up = len(rows) < _READ_COUNT
        state, position = self.state, self.position
        out: list[Envelope] = []
        try:
            with gc_paused():
                for _, entry_id, raw in rows:
                    fields = checked(raw)
                    if fields is None or not fold.fold_checked(state, entry_id, *fields):
                        try:
                            envs = [Envelope(stream, entry_id, decode(raw))]
                        except DecodeError:
                            envs = await log.read(stream, entry_id, entry_id, dead_letter=True)
                        for env in envs:
                            state = fold.evolve(state, env)
                            out.append(env)
                        if state.decided:  # folding stops at the entry that decides it
                            position, self.done = entry_id, True
                            break
                    position = entry_id
        finally:  # the fold is in place: the position keeps up with it, whatever raised
            if position != self.position:
                self._moved(Folded(state, position))
        return out


def _decided(state: RolloutState) -> bool:
    return state.decided


class _Nothing:
    """No state: a relay's follower hands on what it reads."""

    def initial(self) -> None: ...

    def evolve(self, state: None, env: Envelope) -> None: ...


class Finalizer:
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        config: FinalizerConfig,
        *,
        on_ready: Callable[[RolloutReady], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
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
        self._control = Follower(log, self.names.control, ControlProjection())
        self._relays: set[asyncio.Task[None]] = set()  # closed, ending after their read
        self.retention_passes = 0
        window = config.stall_window_s
        self._stalls = StallWatch(log, window, clock=clock) if window is not None else None

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
            await asyncio.gather(*self._relays, return_exceptions=True)

    async def _retain(self, retention: RetentionConfig, stop: asyncio.Event) -> None:
        """One retention pass every ``retention.every_s`` seconds until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=retention.every_s)
            if stop.is_set():
                return
            try:
                report = await retention_pass(
                    self.log, retention.store, keep_s=retention.keep_s,
                    groups=retention.groups, dead_max=retention.dead_max,
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
        f = self._rollout(ev.rollout_id)
        failed = RolloutFailed(
            rollout_id=ev.rollout_id,
            reason=f"finalizing gave up: request {entry.stream}@{entry.id} {entry.error}",
            causation=f"{entry.stream}@{entry.id}",
        )
        at_least: str | None = None
        while True:
            await f.refresh(at_least=at_least)
            if f.done:
                break
            try:
                await self.log.append_if_last(f.stream, failed, f.position)
            except AppendConflict as exc:
                at_least = exc.current  # something was appended: fold it and look again
                continue
            logger.error("rollout %s failed: %s", ev.rollout_id, failed.reason)
            await self._ensure_copy(f, self.names.control, failed)
            return
        if f.state.failed is not None and f.state.failed.causation == failed.causation:
            # this very step ran before and died before its copy
            await self._ensure_copy(f, self.names.control, f.state.failed)

    def _rollout(self, rollout_id: str) -> _Rollout:
        return _Rollout(
            self.log, self.names.rollout(rollout_id),
            block_ms=self.config.block_ms, backoff=Backoff(limit_s=self.config.outage_limit_s),
        )

    async def follow(self, rollout_id: str) -> Outcome:
        """Fold the rollout until it is decided, deciding it when it is ready."""
        f = self._rollout(rollout_id)
        relays: list[Follower[None]] | None = None
        try:
            while not f.done:
                for env in await f.read():
                    if isinstance(env.event, SampleVerified):
                        f.verify.add(env.event)
                if relays is None and f.state.planned is not None:
                    relays = self._relay(f.stream, carried_sources(f.state))
                if f.state.capture is not None and not f.state.decided:
                    # asked for (maybe by a finalizer that died before its copy): make sure
                    # capture workers see it
                    await self._ensure_copy(f, self.names.capture, f.state.capture)
                failed = f.verify.failed(rollout_id) if not f.state.decided else None
                if failed is not None:  # a re-score past its threshold fails the rollout loudly
                    await self._append(f, [failed], (self.names.control, failed))
                elif not f.state.decided and worth_deciding(f.state):
                    await self._decide(f)
                if self._stalls is not None and not f.state.decided:
                    await self._stalls.check(f.stream, f.state)
        finally:
            if self._stalls is not None:
                self._stalls.forget(rollout_id)
            for relay in relays or ():
                relay.close()
        ready = f.state.ready
        if ready is not None:  # always a finalizer's; a RolloutFailed's writer copies it
            try:  # on disk before the trainer hears that the rollout is ready
                await self._write_artifacts(rollout_id, f)
            finally:
                await self._ensure_copy(f, self.names.control, ready)
                carried = await self._tail_carried(f, ready)
                if carried is not None:  # the next request of the stream takes it over
                    await self._ensure_copy(f, self.names.data, carried)
        elif f.state.failed is not None and f.state.failed == f.verify.failed(rollout_id):
            await self._ensure_copy(f, self.names.control, f.state.failed)  # ours, as above
        return await self._finish(rollout_id, f)

    async def _tail_carried(self, f: _Rollout, ready: RolloutReady) -> TailCarried | None:
        """The ``TailCarried`` of a ready rollout whose tail is carried (None: it is not),
        its tasks read back from the stream."""
        if not carries_tail(f.state, ready) or "TailCarried" in f.copied:
            return None
        tasks = await read_tasks(self.log, f.stream, f.state, ready.tail_sample_ids)
        return tail_carried(f.state, ready, tasks)

    async def _ensure_copy(
        self, f: _Rollout, stream: str, event: _Copied
    ) -> None:
        """Copy ``event`` to ``stream`` once, whoever tries (module doc, step 3)."""
        if event.type in f.copied:
            return
        marker = self.names.once(f"{event.type}.{event.rollout_id}")
        await self.log.append_once(stream, event, marker)
        f.copied.add(event.type)

    def _relay(self, stream: str, sources: dict[str, set[str]]) -> list[Follower[None]]:
        """Copy the lifecycle events of carried samples from the streams of the rollouts
        they run in into this rollout's stream, as they come (a tail carried over keeps
        running there), so this rollout's stream alone decides it and replays it: one
        follower per source, until it is closed. A copy written twice (a restart) is a
        duplicate the fold ignores."""
        relays = []
        for source, wanted in sources.items():
            relay = Follower(
                self.log, self.names.rollout(source), _Nothing(), block_ms=self.config.block_ms,
                backoff=Backoff(limit_s=self.config.outage_limit_s),
            )
            task = asyncio.create_task(self._copy(relay, stream, wanted))
            self._relays.add(task)
            task.add_done_callback(self._relay_ended)
            relays.append(relay)
        return relays

    def _relay_ended(self, task: asyncio.Task[None]) -> None:
        self._relays.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.error("relaying carried samples failed: %r", error)

    async def _copy(self, relay: Follower[None], stream: str, wanted: set[str]) -> None:
        while not relay.closed:
            envs = await relay.read()
            copies: list[tuple[str, Event]] = [
                (stream, env.event) for env in envs
                if isinstance(env.event, _RELAYED) and env.event.sample_id in wanted
            ]
            if copies and not relay.closed:
                await ride_out(partial(self.log.append_many, copies), relay.backoff,
                               what=f"copying carried samples into {stream}")

    async def _trainer_version(self, state: RolloutState) -> int | None:
        """The highest version published on ``rl:control`` so far, read only for a request
        with a staleness bound (the only decision it changes)."""
        request = state.request
        if request is None or request.max_staleness is None:
            return None
        await self._control.refresh()
        return self._control.state.published

    async def _decide(self, f: _Rollout) -> None:
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
            # artifacts -- folded up to the RolloutReady -- do not depend on it). The copies
            # follow once the next read has folded it (``follow``).
            await self._append(f, [ready, *tail_aborts(f.state, ready)])

    async def _append(
        self, f: _Rollout, events: list[Event], *also: tuple[str, _Copied]
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

    async def _read_back(self, f: _Rollout) -> Rollout:
        """The fold (up to and including the RolloutReady: what replay folds) with the
        entries of every sample read back."""
        if f.rollout is None:
            state = f.state
            ids = artifact_entries(state)
            f.rollout = Rollout(state, await read_entries(self.log, f.stream, state, ids))
        return f.rollout

    async def _write_artifacts(self, rollout_id: str, f: _Rollout) -> None:
        if self.config.out_dir is not None:
            write_artifacts(await self._read_back(f), self.config.out_dir / rollout_id)

    async def _finish(self, rollout_id: str, f: _Rollout) -> Outcome:
        state = f.state
        if state.ready is not None:
            dumps = self.config.dumps
            if dumps is not None and dumps.armed:  # best-effort: a failure is only logged
                try:
                    write_dumps(await self._read_back(f), dumps)
                except LogError as exc:
                    logger.warning("dumps of rollout %s skipped: %s", rollout_id, exc)
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
