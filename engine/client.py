"""The trainer's client: request a rollout, wait for it, load and collate its samples.

Contract
--------
* ``request(...)`` appends one ``RolloutRequested`` to ``rl:control`` and returns the rollout
  id (given, or ``it<iteration>-<random hex>``). Per-iteration knobs (DAgger beta, t_max)
  travel in ``knobs``; nothing is read from the environment.
* ``wait_ready(rollout_id)`` returns the rollout's ``RolloutReady`` (or raises
  ``engine.errors.RolloutFailed`` with the reason); it reads ``rl:control`` from the request's
  position with blocking reads, so a rollout that became ready before the call is found too.
  A Redis outage does not end the wait: reads are retried with the runtime's capped backoff
  until Redis answers again (or the ``timeout`` passes).
* Reading never writes: an entry that does not decode is skipped by the client (its
  stream's owner dead-letters it).
  ``subscribe_ready()`` yields every ``RolloutReady`` appended after it starts.
* ``load(rollout_id)`` rebuilds the samples from the rollout stream
  (:func:`engine.projections.samples.trainer_samples`): the ids ``RolloutReady`` keeps, in
  its order; aborted samples as masked dummies; one masked dummy when filters emptied it.
  It reads the stream in pages of raw entries and folds only what samples are made of
  (:class:`engine.projections.loading.LoadFold`: tasks, first terminals, teacher scorings,
  stored prompts, the request and the ready event; the rest is not even decoded), with
  the cyclic collector paused while it builds.
* ``wait_load(rollout_id)`` is ``wait_ready`` followed by ``load``, overlapped: while it
  waits on ``rl:control``, a second task folds the rollout stream into the same
  ``LoadFold`` as the entries are appended (blocking reads, pages of raw entries), so when
  the ready event comes only the last entries are left to read and the samples to build.
  Same result, same errors. As in ``load``, the cyclic collector is paused for the call
  (which here includes the wait; what the fold reads is kept, and collections would only
  re-scan it). ``RefillLoop`` uses it.
* ``iter_load(rollout_id, chunk_size)`` yields the same samples in the same order, in lists
  of ``chunk_size``, streaming: a first pass over the stream keeps only a compact index of
  where each sample's entries are (:class:`engine.projections.loading.IndexFold`), then
  each chunk's entries are read back (a few ranges, one round trip) and built. A trainer
  that consumes chunk by chunk holds the index, one page of entries and one chunk, never
  the whole rollout. The CE lane's sub-samples are shuffled across the whole rollout: its
  plan is made first (the completed trajectories read back a page at a time, each kept
  as its chunks' bounds), then each chunk of the plan reads back and builds its parents
  (a trajectory whose sub-samples fall in several chunks is read once per chunk).
* ``collate(samples)`` right-pads into tensors: ``tokens``, ``attention_mask``, ``loss_mask``
  (over the full sequence, prompt positions 0), ``rollout_log_probs`` (same layout, 0 on the
  prompt), ``rewards`` (the scalar reward), ``response_lengths``, ``prompt_lengths``,
  ``remove_sample`` and ``token_versions`` (int64, same layout: the server-reported weight
  version of each sampled token, -1 on the prompt, on padding, on observation tokens and
  where no version is known). The teacher lanes add, when every sample that is not removed
  carries them (masked dummies get zeros): ``teacher_log_probs`` [B, T] float32 (the mixed
  lane's +1.0 sentinel at teacher positions), ``teacher_topk_ids`` [B, T, K] int64,
  ``teacher_topk_log_probs`` [B, T, K] float32, ``action_mask`` [B, T] (student action
  tokens only) and ``is_teacher_mask`` [B, T], all in the layout of ``tokens`` (prompt 0).
* ``SyncRolloutClient`` offers the same calls for synchronous trainer loops; it runs the
  async client on a private event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np
import torch

from engine.agents.result import UNKNOWN_VERSION
from engine.errors import (
    ConfigError,
    DecodeError,
    LogUnavailable,
    RolloutFailed,
    WeightSyncFailed,
)
from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    FilterSpec,
    PolicyVersionActivated,
    PolicyVersionPublished,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
)
from engine.events.catalog import (
    RolloutFailed as RolloutFailedEvent,
)
from engine.events.catalog import (
    WeightSyncFailed as WeightSyncFailedEvent,
)
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID, exclusive, id_before, parse_id
from engine.events.log import EventLog, RawEntry
from engine.events.names import StreamNames
from engine.events.redis_log import open_log
from engine.projections.lanes import CeChunk, Lane, ce_chunks, plan_ce, request_lane
from engine.projections.loading import IndexFold, LoadFold
from engine.projections.policy import PolicyProjection, PolicyState
from engine.projections.samples import (
    ce_samples,
    no_terminal,
    samples_named,
    scalar_reward,
    trainer_samples,
)
from engine.runtime.consumer import Backoff
from engine.runtime.live import LiveFold
from engine.runtime.rebuild import gc_paused
from engine.sample import Sample
from engine.settings import Settings

__all__ = [
    "TEACHER_ALGORITHMS",
    "Iteration",
    "RefillLoop",
    "RolloutClient",
    "SyncRefillLoop",
    "SyncRolloutClient",
    "collate",
]

logger = logging.getLogger(__name__)

_LOAD_PAGE = 4096  # entries per XRANGE page when loading a rollout
_CE_PLAN_PAGE = 1024  # trajectories read back at a time to plan the CE lane (iter_load)

TEACHER_ALGORITHMS = frozenset({"opd", "k3", "distill", "mixed_ce_k3", "dagger_k3"})
"""Algorithms whose loss needs teacher logprobs (the per-token lanes of rollout-engine §5)."""


class RolloutClient:
    """Async client; see the module docstring."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.names = log.names
        self._requested_at: dict[str, str] = {}
        self._published_at: dict[int, str] = {}
        self._policy = LiveFold(log, log.names.control, PolicyProjection())

    @classmethod
    def connect(
        cls,
        url: str | None = None,
        *,
        prefix: str | None = None,
        block_ms: int = 2000,
        producer: str = "trainer",
    ) -> RolloutClient:
        """A client on its own connection, configured as every ``rollout`` command is: the
        URL (default ``ROLLOUT_REDIS_URL``), the prefix (default ``ROLLOUT_STREAM_PREFIX``),
        the credentials and TLS files from ``ROLLOUT_REDIS_*`` (``engine.settings``)."""
        settings = Settings.from_env()
        redis = settings.redis(block_ms=block_ms)
        if url is not None:
            redis = dataclasses.replace(redis, url=url)
        names = StreamNames(settings.stream_prefix if prefix is None else prefix)
        return cls(open_log(redis, names=names, producer=producer))

    async def aclose(self) -> None:
        await self.log.aclose()

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def request(
        self,
        *,
        iteration: int,
        n_prompts: int,
        n_samples_per_prompt: int | None = None,
        policy_version: int = 0,
        knobs: Mapping[str, Any] | None = None,
        kind: RolloutKind | str = RolloutKind.TRAIN,
        filters: FilterSpec | None = None,
        seed: int = 0,
        datasets: Sequence[str] | None = None,
        algorithm: str = "grpo",
        teacher_capture: bool | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        stopping: Mapping[str, Any] | None = None,
        rollout_id: str | None = None,
        max_staleness: int | None = None,
        overprovision: float = 1.0,
        tail: Literal["abort", "carry"] = "abort",
        request_stream: str | None = None,
    ) -> str:
        """Ask for a rollout; returns its id. ``teacher_capture=None`` follows the algorithm.
        ``max_staleness`` / ``overprovision`` / ``tail`` / ``request_stream``: see
        ``RolloutRequested`` (docs/configuration.md, "Staleness and partial rollouts")."""
        rid = rollout_id or f"it{iteration}-{secrets.token_hex(4)}"
        event = RolloutRequested(
            rollout_id=rid,
            iteration=iteration,
            kind=RolloutKind(kind),
            n_prompts=n_prompts,
            n_samples_per_prompt=n_samples_per_prompt,
            policy_version=policy_version,
            seed=seed,
            datasets=list(datasets) if datasets is not None else None,
            algorithm=algorithm,
            knobs=dict(knobs or {}),
            sampling_params=dict(sampling_params or {}),
            stopping=dict(stopping or {}),
            filters=filters or FilterSpec(),
            teacher_capture=(
                algorithm in TEACHER_ALGORITHMS if teacher_capture is None else teacher_capture
            ),
            max_staleness=max_staleness,
            overprovision=overprovision,
            tail=tail,
            request_stream=request_stream,
        )
        self.names.rollout(rid)  # refuses an id that cannot be a stream key
        entry = await self.log.append(self.names.control, event)
        self._requested_at[rid] = entry
        return rid

    async def wait_ready(self, rollout_id: str, timeout: float | None = None) -> RolloutReady:
        """The rollout's ``RolloutReady``; ``RolloutFailed`` raises; ``TimeoutError`` after
        ``timeout`` seconds. While the engine is poisoned by a failed weight sync (nothing
        generates), a rollout that is not ready raises ``engine.errors.WeightSyncFailed``
        with the sync's error; once a later sync succeeded, waiting again goes on."""
        start = self._requested_at.get(rollout_id)
        position = id_before(start) if start is not None else EMPTY_ID
        poison = None
        if position != EMPTY_ID:
            state = await self._policy_now()
            if state.failure is not None and not _later(state.failure_id, position):
                poison = state.failure  # failed before the request, and still failed now
        async for envs, caught_up in self._follow_control(
            position, timeout, f"rollout {rollout_id} not ready"
        ):
            for env in envs:
                ev = env.event
                if isinstance(ev, RolloutReady) and ev.rollout_id == rollout_id:
                    return ev
                if isinstance(ev, RolloutFailedEvent) and ev.rollout_id == rollout_id:
                    raise RolloutFailed(rollout_id, ev.reason)
                if isinstance(ev, WeightSyncFailedEvent):
                    poison = ev
                elif isinstance(ev, PolicyVersionActivated):
                    poison = None
            if poison is not None and caught_up:
                raise _sync_error(poison)
        raise AssertionError("unreachable: _follow_control ends only by raising")

    async def publish_version(self, version: int, weights_uri: str) -> None:
        """Publish policy ``version``, whose weights are in the directory ``weights_uri`` (a
        path or ``file://`` URI every model server can read, Hugging Face format). The
        weight syncer quiesces the engine, loads them on every model server and resumes
        (``engine.actors.weight_sync``); ``wait_version_active`` waits for that."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ConfigError(f"publish_version: version must be an int >= 0, got {version!r}")
        if not isinstance(weights_uri, str) or not weights_uri:
            raise ConfigError(
                f"publish_version: weights_uri must name the weights directory, got "
                f"{weights_uri!r}"
            )
        entry = await self.log.append(
            self.names.control, PolicyVersionPublished(version=version, weights_uri=weights_uri)
        )
        self._published_at[version] = entry

    async def wait_version_active(
        self, version: int, timeout: float | None = None
    ) -> PolicyVersionActivated:
        """The ``PolicyVersionActivated`` of ``version`` or a later one (a publication
        followed by a later one is skipped: the later weights are loaded instead).
        ``engine.errors.WeightSyncFailed`` raises with the original error when the sync of
        ``version`` (or of a later one) failed and no sync succeeded since; ``TimeoutError``
        after ``timeout`` seconds. Reads ``rl:control`` from this client's publication of the
        version, or from the start for a version someone else published."""
        start = self._published_at.get(version)
        position = id_before(start) if start is not None else EMPTY_ID
        failure = None
        async for envs, caught_up in self._follow_control(
            position, timeout, f"policy version {version} not active"
        ):
            for env in envs:
                ev = env.event
                if isinstance(ev, PolicyVersionActivated):
                    if ev.version >= version:
                        return ev
                    failure = None
                elif isinstance(ev, WeightSyncFailedEvent):
                    failure = ev if ev.version >= version else None
            if failure is not None and caught_up:
                raise _sync_error(failure)
        raise AssertionError("unreachable: _follow_control ends only by raising")

    async def policy_state(self) -> PolicyState:
        """The weight-sync state folded from ``rl:control`` (``engine.projections.policy``):
        the trainer's current (highest published) version, the active one, an open sync, a
        failure that poisons the engine."""
        return await self._policy_now()

    async def _policy_now(self) -> PolicyState:
        await self._policy.refresh()
        return self._policy.state

    async def _follow_control(
        self, position: str, timeout: float | None, what: str
    ) -> AsyncIterator[tuple[list[Envelope], bool]]:
        """Batches of ``rl:control`` past ``position``, each with whether it reached the end
        of the stream; rides out Redis outages; ``TimeoutError`` (``what``) at the deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        backoff = Backoff(first_s=0.5, max_s=5.0)
        while True:
            block = self.log.block_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} after {timeout} s")
                block = max(1, min(block, int(left * 1000)))
            try:
                envs, position = await self.log.read_after(
                    self.names.control, position, block_ms=block, count=_READ_COUNT
                )
            except LogUnavailable as exc:  # an outage: wait through it
                pause = backoff.next_pause(exc)
                if deadline is not None:
                    pause = max(0.0, min(pause, deadline - time.monotonic()))
                logger.warning(
                    "%s yet: Redis unavailable, retrying in %.1f s: %s", what, pause, exc
                )
                await asyncio.sleep(pause)
                continue
            backoff.reset()
            yield envs, len(envs) < _READ_COUNT

    async def subscribe_ready(self, *, after: str = "$") -> AsyncIterator[RolloutReady]:
        """Every ``RolloutReady`` appended after ``after`` (default: from now on), forever,
        once per rollout (a finalizer may rarely copy one twice); a ``RolloutFailed``
        raises."""
        seen: set[str] = set()
        async for env in self.log.subscribe(self.names.control, after=after):
            ev = env.event
            if isinstance(ev, RolloutReady):
                if ev.rollout_id not in seen:
                    seen.add(ev.rollout_id)
                    yield ev
            elif isinstance(ev, RolloutFailedEvent):
                raise RolloutFailed(ev.rollout_id, ev.reason)

    async def load(self, rollout_id: str) -> list[Sample]:
        """The rollout's samples, rebuilt from its stream (see the module docstring)."""
        with gc_paused():  # what is built is kept: collections would only re-scan it
            return await self._load(self.names.rollout(rollout_id))

    async def _load(self, stream: str) -> list[Sample]:
        # Its own frame: the fold is freed when it returns, before the collector is back on
        # (whose first pass then walks the samples only).
        fold = LoadFold()
        await self._scan(stream, fold)
        return trainer_samples(fold.state())

    async def wait_load(
        self, rollout_id: str, timeout: float | None = None
    ) -> tuple[RolloutReady, list[Sample]]:
        """``wait_ready`` and then ``load``, in one call that overlaps them: while it waits,
        the rollout stream is folded as it is written (see the module docstring). Returns
        what ``wait_ready(rollout_id, timeout)`` and then ``load(rollout_id)`` return, and
        raises what they raise."""
        stream = self.names.rollout(rollout_id)
        with gc_paused():  # as in load: what is read is kept, and it is read while waiting
            return await self._wait_load(rollout_id, stream, timeout)

    async def _wait_load(
        self, rollout_id: str, stream: str, timeout: float | None
    ) -> tuple[RolloutReady, list[Sample]]:
        fold = LoadFold()
        waited = asyncio.Event()
        follow = asyncio.create_task(self._follow(stream, fold, waited))
        try:
            ready = await self.wait_ready(rollout_id, timeout)
        except BaseException:
            follow.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follow
            raise
        waited.set()
        position = await follow
        return ready, await self._finish_load(stream, fold, position)

    async def _finish_load(self, stream: str, fold: LoadFold, position: str) -> list[Sample]:
        # The entries past what the follower folded (the rest of a page, an aborted tail
        # recorded after the RolloutReady), then the samples; the fold is freed on return.
        start = "-" if position == EMPTY_ID else exclusive(position)
        await self._scan(stream, fold, start=start)
        return trainer_samples(fold.state())

    async def _follow(self, stream: str, fold: LoadFold, waited: asyncio.Event) -> str:
        """Fold ``stream`` into ``fold`` as it is written, with blocking reads, until the
        fold holds the rollout's ``RolloutReady`` or ``waited`` is set (the control plane
        has the ready event: the rollout stream had it first, unless it is gone); returns
        the id of the last entry folded. An outage pauses it (``wait_ready`` rides it out
        and says when it is over); what it missed, ``_finish_load`` reads."""
        position = EMPTY_ID
        backoff = Backoff(first_s=0.5, max_s=5.0)
        while fold.ready is None and not waited.is_set():
            try:
                rows = await self.log.tail_raw({stream: position}, count=_LOAD_PAGE)
            except LogUnavailable as exc:
                await asyncio.sleep(backoff.next_pause(exc))
                continue
            backoff.reset()
            if rows:
                position = rows[-1][1]
                fold.feed((entry_id, raw) for _stream, entry_id, raw in rows)
        return position

    async def iter_load(
        self, rollout_id: str, chunk_size: int = 1024
    ) -> AsyncGenerator[list[Sample], None]:
        """``load``'s samples, ``chunk_size`` at a time (see the module docstring)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        stream = self.names.rollout(rollout_id)
        index = IndexFold()
        with gc_paused():  # the collector stays on while the caller holds a chunk
            # Pages of about a chunk's entries (a sample has a few): memory follows the
            # caller's chunk size, not the rollout's.
            await self._scan(stream, index, min(_LOAD_PAGE, max(256, 4 * chunk_size)))
        ready = index.ready
        if ready is None or ready.dummy:
            # Nothing to stream (no ready event: the error; a dummy: one sample).
            with gc_paused():
                whole = await self._load(stream)
            for at in range(0, len(whole), chunk_size):
                yield whole[at : at + chunk_size]
            return
        lane = request_lane(index.request)
        if lane is Lane.CE:
            async for sub_samples in self._iter_ce(stream, index, chunk_size):
                yield sub_samples
            return
        ids = ready.sample_ids
        for at in range(0, len(ids), chunk_size):
            part = ids[at : at + chunk_size]
            with gc_paused():
                events = await self._read_back(stream, index, part)
                samples = samples_named(index.chunk_state(part, events), part, lane)
                del events
            yield samples
            del samples

    async def _iter_ce(
        self, stream: str, index: IndexFold, chunk_size: int
    ) -> AsyncGenerator[list[Sample], None]:
        """The CE lane's sub-samples, ``chunk_size`` at a time, as ``load`` orders them: the
        plan (which trajectory gives which chunks, shuffled across the whole rollout) is made
        from the completed trajectories read back a page at a time, each kept as its chunks'
        bounds only; then each chunk of the plan reads back and builds its parents."""
        ready = index.ready
        assert ready is not None
        for sample_id in ready.sample_ids:
            if not index.has_terminal(sample_id):
                raise no_terminal(index.rollout_id, sample_id)
        completed = [sid for sid in ready.sample_ids if index.completed(sid)]
        trajectories: list[tuple[str, list[CeChunk]]] = []
        page = min(_CE_PLAN_PAGE, max(256, chunk_size))  # memory follows the chunk size
        for at in range(0, len(completed), page):
            part = completed[at : at + page]
            with gc_paused():
                state = index.chunk_state(part, await self._read_back(stream, index, part))
                for sid in part:
                    done = state.samples[sid].completed
                    assert done is not None
                    trajectories.append((sid, ce_chunks(done)))
                del state
        plan = plan_ce(index.request, trajectories).chunks
        del trajectories
        if not plan:
            yield [Sample.masked_dummy(policy_version=ready.policy_version)]
            return
        for at in range(0, len(plan), chunk_size):
            part_plan = plan[at : at + chunk_size]
            parents = list(dict.fromkeys(c.sample_id for c in part_plan))
            with gc_paused():
                events = await self._read_back(stream, index, parents)
                samples = ce_samples(index.chunk_state(parents, events), part_plan)
                del events
            yield samples
            del samples

    async def _scan(
        self,
        stream: str,
        fold: LoadFold | IndexFold,
        page: int = _LOAD_PAGE,
        *,
        start: str = "-",
    ) -> None:
        """Fold every entry of ``stream`` from ``start`` on into ``fold``, ``page`` raw
        entries at a time; the next page is asked for before this one is folded, so Redis
        serves it meanwhile."""

        async def read(start: str) -> list[RawEntry]:
            (rows,) = await self.log.read_raw_ranges(stream, [(start, "+", page)])
            return rows

        pending: asyncio.Task[list[RawEntry]] | None = asyncio.create_task(read(start))
        try:
            while pending is not None:
                rows = await pending
                pending = None
                if len(rows) == page:
                    pending = asyncio.create_task(read(exclusive(rows[-1][0])))
                fold.feed(rows)
        finally:
            if pending is not None:
                pending.cancel()

    async def _read_back(
        self, stream: str, index: IndexFold, sample_ids: Sequence[str]
    ) -> dict[int, Event]:
        """The entries the samples of ``sample_ids`` are built from, decoded, by ordinal:
        read in a few ranges, in one round trip."""
        wanted = index.wanted(sample_ids)
        ranges = index.ranges(wanted)
        replies = await self.log.read_raw_ranges(
            stream, [(start, "+", count) for start, count, _first in ranges]
        )
        keep = set(wanted)
        events: dict[int, Event] = {}
        for (_start, _count, first), rows in zip(ranges, replies, strict=True):
            for offset, (_entry_id, raw) in enumerate(rows):
                if first + offset in keep:
                    try:
                        events[first + offset] = decode(raw)
                    except DecodeError:
                        pass  # named by chunk_state: not the entry the first pass read
        return events


@dataclass(frozen=True, slots=True)
class Iteration:
    """One rollout of a ``RefillLoop``: its number, id, ``RolloutReady`` and samples, and the
    policy version the trainer was at when it was requested."""

    iteration: int
    rollout_id: str
    ready: RolloutReady
    samples: list[Sample]
    requested_version: int


class RefillLoop:
    """The trainer's loop with async refill (seeds: "Async AR refills the same manager
    immediately after collection"): rollout N+1 is requested *before* the trainer gets
    rollout N, so the engine generates it while the trainer trains on N. ::

        loop = RefillLoop(client, n_prompts=8, n_samples_per_prompt=4)
        async for it in loop.iterations(100):
            train(collate(it.samples))
            await loop.publish(it.iteration + 1, save_weights(it.iteration + 1))

    ``publish`` appends ``PolicyVersionPublished`` and returns at once: the weight syncer
    lands the new weights at the next turn boundary of the trajectories in flight (the
    worker's gate), and every later request carries the new ``policy_version``. A failed
    sync surfaces at the next ``wait_ready`` as ``WeightSyncFailed``. ``ahead`` is how many
    rollouts are requested beyond the one being trained on (0: the synchronous loop:
    request, wait, train, publish). ``request_kwargs`` go to every ``client.request``.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        ahead: int = 1,
        version: int = 0,
        start_iteration: int = 0,
        timeout: float | None = None,
        **request_kwargs: Any,
    ) -> None:
        if ahead < 0:
            raise ConfigError(f"RefillLoop: ahead must be >= 0, got {ahead}")
        for reserved in ("iteration", "policy_version", "rollout_id"):
            if reserved in request_kwargs:
                raise ConfigError(f"RefillLoop sets {reserved} itself; do not pass it")
        self.client = client
        self.ahead = ahead
        self.version = version
        self.timeout = timeout
        self.request_kwargs = request_kwargs
        self._next = start_iteration
        self._pending: list[tuple[int, str, int]] = []  # (iteration, rollout id, version)

    async def _request_one(self) -> None:
        iteration, self._next = self._next, self._next + 1
        rid = await self.client.request(
            iteration=iteration, policy_version=self.version, **self.request_kwargs
        )
        self._pending.append((iteration, rid, self.version))

    async def iterations(self, n: int) -> AsyncIterator[Iteration]:
        """``n`` rollouts in order; before waiting for one, the next ``ahead`` are requested."""
        last = self._next + n
        while True:
            while self._next < last and len(self._pending) < self.ahead + 1:
                await self._request_one()
            if not self._pending:
                return
            iteration, rid, version = self._pending.pop(0)
            ready, samples = await self.client.wait_load(rid, self.timeout)
            yield Iteration(iteration, rid, ready, samples, version)

    async def publish(
        self, version: int, weights_uri: str, *, wait: bool = False
    ) -> PolicyVersionActivated | None:
        """Publish new weights; requests from now on carry ``version``. ``wait=True`` also
        waits for them to be active (``wait_version_active``)."""
        await self.client.publish_version(version, weights_uri)
        self.version = version
        if wait:
            return await self.client.wait_version_active(version, self.timeout)
        return None


_READ_COUNT = 500


def _later(a: str | None, b: str) -> bool:
    return a is not None and parse_id(a) > parse_id(b)


def _sync_error(failed: WeightSyncFailedEvent) -> WeightSyncFailed:
    return WeightSyncFailed(failed.version, failed.error, failed.servers_failed)


def collate(samples: Sequence[Sample], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch of tensors (see the module docstring).

    Each field is built as one numpy array and handed to torch once: the samples' packed
    arrays are joined (bytes, no per-token Python objects) and scattered into the padded
    batch with one boolean-mask assignment in row-major order, which is exactly "row i,
    positions 0..n_i" for the tokens and "row i, its response positions" for the rest.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    batch = len(samples)
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=batch)
    responses = np.fromiter((s.response_length for s in samples), dtype=np.int64, count=batch)
    width = int(lengths.max())
    position = np.arange(width, dtype=np.int64)
    valid = position < lengths[:, None]
    response = valid & (position >= (lengths - responses)[:, None])

    tokens = np.full((batch, width), pad_token_id, dtype=np.int64)
    tokens[valid] = _joined(TokenIds, [s.tokens for s in samples])
    loss_mask = np.zeros((batch, width), dtype=np.float32)
    loss_mask[response] = _joined(Mask, [s.loss_mask for s in samples])
    logprobs = np.zeros((batch, width), dtype=np.float32)
    logprobs[response] = _joined(
        LogProbs, [_or_zeros(s.rollout_log_probs, s.response_length) for s in samples]
    )
    out = {
        "tokens": torch.from_numpy(tokens),
        "attention_mask": torch.from_numpy(valid.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask),
        "rollout_log_probs": torch.from_numpy(logprobs),
        "rewards": torch.from_numpy(
            np.array([scalar_reward(s.reward) for s in samples], dtype=np.float32)
        ),
        "response_lengths": torch.from_numpy(responses),
        "prompt_lengths": torch.from_numpy(lengths - responses),
        "remove_sample": torch.from_numpy(
            np.fromiter((s.remove_sample for s in samples), dtype=np.bool_, count=batch)
        ),
    }
    versions = np.full((batch, width), UNKNOWN_VERSION, dtype=np.int64)
    versions[response] = _joined(
        TokenIds, [_or_unknown(s.token_versions, s.response_length) for s in samples]
    )
    out["token_versions"] = torch.from_numpy(versions)
    per_token: tuple[tuple[str, type[PackedArray], Any], ...] = (
        ("teacher_log_probs", LogProbs, np.float32),
        ("action_mask", Mask, np.float32),
        ("is_teacher_mask", Mask, np.float32),
    )
    for name, kind, dtype in per_token:
        arrays = _lane_field(samples, name)
        if arrays is not None:
            values = np.zeros((batch, width), dtype=dtype)
            values[response] = _joined(
                kind, [a if a is not None else kind(bytes(kind.itemsize * s.response_length))
                       for a, s in zip(arrays, samples, strict=True)]
            )
            out[name] = torch.from_numpy(values)
    if _lane_field(samples, "teacher_topk_ids") is not None:
        out.update(_topk(samples, width))
    return out


def _lane_field(samples: Sequence[Sample], name: str) -> list[Any] | None:
    """A lane's per-token field of each sample, when every sample that is not removed has it
    (and one does); removed samples (masked dummies) then get zeros. None: not a batch field."""
    arrays = [getattr(s, name) for s in samples]
    kept = [a for a, s in zip(arrays, samples, strict=True) if not s.remove_sample]
    if not any(a is not None for a in arrays) or any(a is None for a in kept):
        return None
    return arrays


def _topk(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    """``teacher_topk_ids`` [B, T, K] int64 and ``teacher_topk_log_probs`` [B, T, K] float32,
    aligned with ``tokens`` (zeros on the prompt, padding and removed samples)."""
    ks = {s.teacher_top_k for s in samples if s.teacher_topk_ids is not None}
    if len(ks) != 1:
        raise ValueError(f"collate: the samples' teacher top-K differ: {sorted(ks)}")
    (k,) = ks
    batch = len(samples)
    ids = np.zeros((batch, width, k), dtype=np.int64)
    lps = np.zeros((batch, width, k), dtype=np.float32)
    # Row by row: each sample's rows are one contiguous block (a copy, no boolean scatter
    # over a [B, T, K] array).
    for row, s in enumerate(samples):
        if s.teacher_topk_ids is None or s.teacher_topk_log_probs is None:
            continue  # a removed sample: zeros
        end = len(s.tokens)
        start = end - s.response_length
        ids[row, start:end] = s.teacher_topk_ids.numpy().reshape(-1, k)
        lps[row, start:end] = s.teacher_topk_log_probs.numpy().reshape(-1, k)
    return {
        "teacher_topk_ids": torch.from_numpy(ids),
        "teacher_topk_log_probs": torch.from_numpy(lps),
    }


def _joined(kind: type[PackedArray], arrays: Sequence[PackedArray]) -> np.ndarray[Any, Any]:
    """The arrays' values end to end, as one read-only numpy array of ``kind``'s dtype."""
    return np.frombuffer(b"".join(a.data for a in arrays), dtype=kind.dtype)


def _or_zeros(array: LogProbs | None, n: int) -> PackedArray:
    return array if array is not None else LogProbs(bytes(LogProbs.dtype.itemsize * n))


_UNKNOWN_INT32 = np.array([UNKNOWN_VERSION], dtype=TokenIds.dtype).tobytes()


def _or_unknown(array: TokenIds | None, n: int) -> PackedArray:
    return array if array is not None else TokenIds(_UNKNOWN_INT32 * n)


class SyncRolloutClient:
    """The same calls for synchronous code, on a private event loop (not thread-safe)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        prefix: str | None = None,
        block_ms: int = 2000,
        producer: str = "trainer",
    ) -> None:
        """See :meth:`RolloutClient.connect` (the settings it reads)."""
        self._runner = asyncio.Runner()
        self._client = self._runner.run(
            _make(url, prefix=prefix, block_ms=block_ms, producer=producer)
        )

    def request(self, **kwargs: Any) -> str:
        """See :meth:`RolloutClient.request`."""
        return self._runner.run(self._client.request(**kwargs))

    def wait_ready(self, rollout_id: str, timeout: float | None = None) -> RolloutReady:
        return self._runner.run(self._client.wait_ready(rollout_id, timeout))

    def load(self, rollout_id: str) -> list[Sample]:
        return self._runner.run(self._client.load(rollout_id))

    def wait_load(
        self, rollout_id: str, timeout: float | None = None
    ) -> tuple[RolloutReady, list[Sample]]:
        """See :meth:`RolloutClient.wait_load`."""
        return self._runner.run(self._client.wait_load(rollout_id, timeout))

    def publish_version(self, version: int, weights_uri: str) -> None:
        """See :meth:`RolloutClient.publish_version`."""
        self._runner.run(self._client.publish_version(version, weights_uri))

    def wait_version_active(
        self, version: int, timeout: float | None = None
    ) -> PolicyVersionActivated:
        """See :meth:`RolloutClient.wait_version_active`."""
        return self._runner.run(self._client.wait_version_active(version, timeout))

    def refill_loop(self, **loop_kwargs: Any) -> SyncRefillLoop:
        """A :class:`RefillLoop` for synchronous code (same arguments)."""
        return SyncRefillLoop(self._runner, RefillLoop(self._client, **loop_kwargs))

    def iter_load(self, rollout_id: str, chunk_size: int = 1024) -> Iterator[list[Sample]]:
        """See :meth:`RolloutClient.iter_load`."""
        chunks = self._client.iter_load(rollout_id, chunk_size)
        try:
            while True:
                try:
                    yield self._runner.run(anext(chunks))
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(chunks.aclose())

    def close(self) -> None:
        self._runner.run(self._client.aclose())
        self._runner.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncRefillLoop:
    """:class:`RefillLoop` on a ``SyncRolloutClient``'s event loop::

        loop = client.refill_loop(ahead=1, n_prompts=64, n_samples_per_prompt=8)
        for it in loop.iterations(num_steps):
            train_step(collate(it.samples))
            loop.publish(it.iteration + 1, save_weights(it.iteration + 1))
    """

    def __init__(self, runner: asyncio.Runner, loop: RefillLoop) -> None:
        self._runner = runner
        self.loop = loop

    @property
    def version(self) -> int:
        return self.loop.version

    def iterations(self, n: int) -> Iterator[Iteration]:
        it = self.loop.iterations(n).__aiter__()

        async def step() -> Iteration | None:
            try:
                return await it.__anext__()
            except StopAsyncIteration:
                return None

        while (item := self._runner.run(step())) is not None:
            yield item

    def publish(
        self, version: int, weights_uri: str, *, wait: bool = False
    ) -> PolicyVersionActivated | None:
        return self._runner.run(self.loop.publish(version, weights_uri, wait=wait))


async def _make(
    url: str | None, *, prefix: str | None, block_ms: int, producer: str
) -> RolloutClient:
    return RolloutClient.connect(url, prefix=prefix, block_ms=block_ms, producer=producer)
