"""The trainer's client: request a rollout, wait for it, load and collate its samples.

Contract
--------
* ``request(...)`` appends one ``RolloutRequested`` to ``rl:control`` and returns the rollout
  id (given, or ``it<iteration>-<random hex>``). Per-iteration knobs (DAgger beta, t_max)
  travel in ``knobs``; nothing is read from the environment.
* ``wait_ready(rollout_id)`` returns the rollout's ``RolloutReady`` (or raises
  ``engine.errors.RolloutFailed`` with the reason). The client folds ``rl:control`` once
  (``control``, a follower of :mod:`engine.projections.control`, read by the waits with
  blocking reads), and that fold keeps each rollout's outcome, so a rollout that became
  ready before the call is found too; the event is then read back by its entry id.
  A Redis outage does not end the wait: reads are retried with the runtime's capped backoff
  until Redis answers again (or the ``timeout`` passes).
* Reading never writes: an entry that does not decode is skipped by the client (its
  stream's owner dead-letters it).
  ``subscribe_ready()`` yields every ``RolloutReady`` appended after it starts.
* ``load(rollout_id)`` rebuilds the samples from the rollout stream
  (:func:`engine.projections.samples.trainer_samples`): the ids ``RolloutReady`` keeps, in
  its order; aborted samples as masked dummies; one masked dummy when filters emptied it.
  It reads the stream in pages of raw entries and folds the entries samples are built from
  into the rollout fold, keeping them as read (``engine.runtime.readback``; the rest is
  not even decoded), with the cyclic collector paused while it builds.
* ``wait_load(rollout_id)`` is ``wait_ready`` followed by ``load``, overlapped: while it
  waits on ``rl:control``, a second task folds the rollout stream as the entries are
  appended (a ``LoadFollower``: blocking reads, pages of raw entries), so when the ready
  event comes only the last entries are left to read and the samples to build. Same
  result, same errors. As in ``load``, the cyclic collector is paused for the call (which
  here includes the wait; what the fold reads is kept, and collections would only re-scan
  it). ``RefillLoop`` uses it.
* ``iter_load(rollout_id, chunk_size)`` yields the same samples in the same order, in lists
  of ``chunk_size``, streaming: a first pass over the stream keeps only the fold's records
  (where each sample's entries are), then each chunk's entries are read back by id (a few
  ranges, one round trip) and built. A trainer that consumes chunk by chunk holds the
  records, one page of entries and one chunk, never the whole rollout. The CE lane's
  sub-samples are shuffled across the whole rollout: its plan is made first (the
  completed trajectories read back a page at a time, each kept as its chunks' bounds),
  then each chunk of the plan reads back and builds its parents.
* ``reuse(source, iteration=...)`` makes a rollout of a stored one (a ready rollout's id on
  this log, or an archive file) instead of generating it: ready at once, loaded like any
  other, its stream headed by ``RolloutReused`` naming the source
  (:mod:`engine.runtime.reuse`, which also has ``load_archive``, samples straight from an
  archive file, and ``reuse_source``, the stored rollout of an iteration).
* ``collate(samples)`` right-pads samples into tensors (:mod:`engine.collate`).
* ``SyncRolloutClient`` offers the same calls for synchronous trainer loops; it runs the
  async client on a private event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

from engine.collate import collate
from engine.errors import (
    ConfigError,
    RolloutError,
    RolloutFailed,
    WeightSyncFailed,
)
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
from engine.events.catalog.control import (
    STALENESS_POLICIES,
    StalenessPolicy,
)
from engine.events.ids import EMPTY_ID, exclusive, id_before, parse_id
from engine.events.log import EventLog
from engine.events.names import StreamNames
from engine.events.redis_log import open_log
from engine.projections.control import ControlProjection, ControlState
from engine.projections.samples import trainer_samples
from engine.runtime.consumer import Backoff, ride_out
from engine.runtime.follower import Follower
from engine.runtime.readback import LoadFollower, StreamLoad, iter_samples, load_samples, scan
from engine.runtime.rebuild import gc_paused
from engine.runtime.reuse import archive_files, load_archive, reuse_rollout, reuse_source
from engine.sample import Sample
from engine.settings import Settings

__all__ = [
    "TEACHER_ALGORITHMS",
    "Iteration",
    "RefillLoop",
    "RolloutClient",
    "SyncRefillLoop",
    "SyncRolloutClient",
    "archive_files",
    "collate",
    "load_archive",
    "reuse_source",
]

TEACHER_ALGORITHMS = frozenset({"opd", "k3", "distill", "mixed_ce_k3", "dagger_k3"})
"""Algorithms whose loss needs teacher logprobs (the per-token and mixed lanes)."""

DEFAULT_STALENESS_POLICY: StalenessPolicy = "pace"
"""The ``staleness_policy`` a request gets unless it names one: the only one of the three that
kept the share of long episodes reaching the trainer at 0.8 or more of the synchronous run's
under async refill (``bench/staleness.py``: pace 1.0, keep 0.63-0.71, drop 0.25-0.43;
docs/configuration.md, "Staleness and partial rollouts")."""


class RolloutClient:
    """Async client; see the module docstring."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.names = log.names
        self._published_at: dict[int, str] = {}
        # rl:control, followed once (by the waits themselves: they read it as they wait).
        self.control = Follower(
            log, log.names.control, ControlProjection(), backoff=Backoff(first_s=0.5, max_s=5.0)
        )

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
        staleness_policy: StalenessPolicy = DEFAULT_STALENESS_POLICY,
        overprovision: float = 1.0,
        tail: Literal["abort", "carry"] = "abort",
        request_stream: str | None = None,
        pinned_version: int | None = None,
        max_version_span: int | None = None,
    ) -> str:
        """Ask for a rollout; returns its id. ``teacher_capture=None`` follows the algorithm.
        ``max_staleness`` / ``staleness_policy`` / ``overprovision`` / ``tail`` /
        ``request_stream`` / ``max_version_span``: see ``RolloutRequested``
        (docs/configuration.md, "Staleness and partial rollouts"); an unknown
        ``staleness_policy`` or a value out of range raises before anything is appended.
        ``pinned_version`` (``kind="eval"`` only): the eval runs on that weight version while
        training goes on (docs/operations.md, "Eval pinned to a version")."""
        if staleness_policy not in STALENESS_POLICIES:
            raise ConfigError(
                f"request: staleness_policy must be one of {', '.join(STALENESS_POLICIES)}; "
                f"got {staleness_policy!r}"
            )
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
            staleness_policy=staleness_policy,
            overprovision=overprovision,
            tail=tail,
            request_stream=request_stream,
            pinned_version=pinned_version,
            max_version_span=max_version_span,
        )
        self.names.rollout(rid)  # refuses an id that cannot be a stream key
        await self.log.append(self.names.control, event)
        return rid

    async def wait_ready(self, rollout_id: str, timeout: float | None = None) -> RolloutReady:
        """The rollout's ``RolloutReady``; ``RolloutFailed`` raises; ``TimeoutError`` after
        ``timeout`` seconds. While the engine is poisoned by a failed weight sync (nothing
        generates), a rollout that is not ready raises ``engine.errors.WeightSyncFailed``
        with the sync's error; once a later sync succeeded, waiting again goes on."""
        state = await self.control.wait_for(
            lambda s: rollout_id in s.outcomes or s.failure is not None,
            timeout, what=f"rollout {rollout_id} not ready",
        )
        entry = state.outcomes.get(rollout_id)
        if entry is None:
            assert state.failure is not None
            raise _sync_error(state.failure)
        stream = self.names.control
        found = await ride_out(
            lambda: self.log.read(stream, entry, entry), self.control.backoff,
            what=f"reading the outcome of rollout {rollout_id}",
        )
        ev = found[0].event if found else None
        if isinstance(ev, RolloutReady):
            return ev
        if isinstance(ev, RolloutFailedEvent):
            raise RolloutFailed(rollout_id, ev.reason)
        raise RolloutError(
            f"rollout {rollout_id}: its outcome {stream}@{entry} is no longer there "
            "(trimmed by retention)"
        )

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
        after = id_before(start) if start is not None else EMPTY_ID

        def activated(s: ControlState) -> bool:
            a = s.activated
            return a is not None and a.version >= version and _later(s.activated_id, after)

        def failed(s: ControlState) -> bool:
            f = s.failure
            return f is not None and f.version >= version and _later(s.failure_id, after)

        state = await self.control.wait_for(
            lambda s: activated(s) or failed(s), timeout,
            what=f"policy version {version} not active",
        )
        if state.activated is not None and activated(state):
            return state.activated
        assert state.failure is not None
        raise _sync_error(state.failure)

    async def policy_state(self) -> ControlState:
        """The control state folded from ``rl:control`` (``engine.projections.control``):
        the trainer's current (highest published) version, the active one, an open sync, a
        failure that poisons the engine."""
        await self.control.refresh()
        return self.control.state

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
            return await load_samples(self.log, self.names.rollout(rollout_id))

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
        load = StreamLoad(stream, keep=True)
        follower = LoadFollower(self.log, load, backoff=Backoff(first_s=0.5, max_s=5.0))
        following = asyncio.create_task(follower.run(), name=f"follow {stream}")
        try:
            ready = await self.wait_ready(rollout_id, timeout)
        except BaseException:
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
            raise
        follower.close()
        await following
        # The entries past what the follower folded (the rest of a page, an aborted tail
        # recorded after the RolloutReady), then the samples.
        position = follower.position
        await scan(self.log, load, start="-" if position == EMPTY_ID else exclusive(position))
        return ready, trainer_samples(load.rollout())

    async def iter_load(
        self, rollout_id: str, chunk_size: int = 1024
    ) -> AsyncGenerator[list[Sample], None]:
        """``load``'s samples, ``chunk_size`` at a time (see the module docstring)."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
        chunks = iter_samples(self.log, self.names.rollout(rollout_id), chunk_size)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    async def reuse(self, source: str, *, iteration: int, rollout_id: str | None = None) -> str:
        """A rollout made of the stored rollout ``source`` (a ready rollout's id on this log,
        or an archive file) instead of a generated one; returns its id (given, or
        ``it<iteration>-reuse-<random hex>``), ready at once (:mod:`engine.runtime.reuse`)."""
        rid = rollout_id or f"it{iteration}-reuse-{secrets.token_hex(4)}"
        await reuse_rollout(self.log, source, rollout_id=rid, iteration=iteration)
        return rid


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


def _later(a: str | None, b: str) -> bool:
    return a is not None and parse_id(a) > parse_id(b)


def _sync_error(failed: WeightSyncFailedEvent) -> WeightSyncFailed:
    return WeightSyncFailed(failed.version, failed.error, failed.servers_failed)


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

    def reuse(self, source: str, *, iteration: int, rollout_id: str | None = None) -> str:
        """See :meth:`RolloutClient.reuse`."""
        return self._runner.run(
            self._client.reuse(source, iteration=iteration, rollout_id=rollout_id)
        )

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
