"""``Follower``: a projection kept live from one stream -- every reader of a stream outside
a consumer group (the scheduler's pool, ``rl:control`` once per process, a rollout the
finalizer decides, the trainer's waits).

* ``refresh(at_least=)`` folds the tail without blocking; ``apply`` folds what the caller
  appended itself. A compare-and-append writer passes ``position`` as ``expected_last``
  and, after an ``AppendConflict``, calls ``refresh(at_least=conflict.current)``: the
  position moves past dead-lettered entries too, which never reach the fold.
* ``read()`` is one blocking read (at most ``block_ms``), folded; ``run()`` reads until
  ``close()``. A read that cannot reach Redis pauses for the runtime's ``Backoff``, and the
  next one resumes at the position; past the outage limit it raises ``OutageExceeded``
  (docs/architecture.md, "Deliveries, outages and leases"). A stop never cancels a read
  (redis-py does not reliably survive one cancelled mid-socket): ``close()`` is seen
  between reads and cuts a pause short.
* ``version`` counts the moves of the position: ``changed(since)`` returns once it is past a
  version read earlier, ``wait_for(predicate)`` once the state satisfies it, so a waiter
  misses no change. While ``run()`` follows, waiters wake on its reads; otherwise a waiter
  reads itself. Both raise ``FollowerClosed`` once closed.
* ``owner``: this reader owns the stream and dead-letters (once) what does not decode;
  other readers skip such entries. ``until``: folding stops at the first entry after which
  ``until(state)`` holds (``done``), and the position stays there.
* A ``Snapshottable`` projection (the pool) starts from its stored snapshot and folds the
  tail after it; a fold whose position was trimmed away meanwhile
  (``engine.runtime.retention``) starts again from the newer snapshot.

:func:`following` runs followers beside an actor's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Generic, TypeVar, cast

from engine import metrics
from engine.errors import LogError
from engine.events.base import Envelope
from engine.events.ids import EMPTY_ID, later_id, parse_id
from engine.events.log import EventLog
from engine.projections.base import Folded, Projection, Snapshottable, start
from engine.runtime.consumer import Backoff
from engine.runtime.rebuild import load_snapshot

__all__ = ["Follower", "FollowerClosed", "following"]

logger = logging.getLogger(__name__)

S = TypeVar("S")
_PAGE = 500  # entries per read


class FollowerClosed(Exception):
    """``Follower.close()`` was called while someone waited on it."""


class Follower(Generic[S]):
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        stream: str,
        projection: Projection[S],
        *,
        owner: bool = False,
        block_ms: int | None = None,
        backoff: Backoff | None = None,
        until: Callable[[S], bool] | None = None,
    ) -> None:
        self.log = log
        self.stream = stream
        self.projection = projection
        self.owner = owner
        self.block_ms = block_ms
        self.backoff = backoff or Backoff()
        self.until = until
        self.folded: Folded[S] = start(projection)
        self.version = 0
        self.done = False
        self.caught_up = False  # the last read reached the stream's end
        self._snapshots = isinstance(projection, Snapshottable)
        self._following = False
        self._woken = asyncio.Event()
        self._stopped = asyncio.Event()
        self._reading = asyncio.Lock()

    @property
    def state(self) -> S:
        return self.folded.state

    @property
    def position(self) -> str:
        return self.folded.position

    @property
    def closed(self) -> bool:
        return self._stopped.is_set()

    def _wake(self) -> None:
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def apply(
        self, envelopes: Sequence[Envelope], *, at_least: str | None = None
    ) -> list[Envelope]:
        """Fold the envelopes past the position (up to ``until``); returns those folded."""
        before = self.folded
        new = [] if self.done else _past(envelopes, before.position)
        state, position = before.state, before.position
        evolve, until = self.projection.evolve, self.until
        n = 0
        for env in new:
            state = evolve(state, env)
            position = env.id
            n += 1
            if until is not None and until(state):
                self.done = True
                break
        if at_least is not None and not self.done:
            position = later_id(position, at_least)
        if position != before.position:
            self._moved(Folded(state, position))
        return new if n == len(new) else new[:n]

    def _moved(self, folded: Folded[S]) -> None:
        self.folded = folded
        self.version += 1
        self._wake()

    async def _reseat(self) -> None:
        """A snapshottable fold that has read nothing, or whose position was trimmed away,
        starts from the stored snapshot (module docstring)."""
        if self.position != EMPTY_ID:
            first = await self.log.first_id(self.stream)
            if first != EMPTY_ID and parse_id(first) <= parse_id(self.position):
                return
        snapshot = await load_snapshot(self.log, cast(Snapshottable[S], self.projection))
        if snapshot is not None and not self.folded.covers(snapshot.position):
            self._moved(snapshot)

    async def refresh(self, *, at_least: str | None = None) -> list[Envelope]:
        """Fold the stream's tail past the position, without blocking; returns what it
        folded. Errors of the log are the caller's."""
        if self.done:
            return []
        if self._snapshots:
            await self._reseat()
        tail = await self.log.read_all(self.stream, after=self.position, dead_letter=self.owner)
        self.caught_up = True
        return self.apply(tail, at_least=at_least)

    async def read(self, timeout: float | None = None, *, block: bool = True) -> list[Envelope]:
        """One read past the position, blocking (``timeout`` bounds its wait) unless
        ``block`` is False, folded; returns what it folded. Nothing when another read
        folded meanwhile, or when Redis could not be reached (after the backoff's pause,
        which ``timeout`` bounds too; module docstring)."""
        seen = self.version
        async with self._reading:
            if self.version != seen or self.closed or self.done:
                return []
            block_ms = self.log.block_ms if self.block_ms is None else self.block_ms
            if not block:
                block_ms = 0
            elif timeout is not None:
                block_ms = max(1, min(block_ms, int(timeout * 1000)))
            try:
                folded = await self._fetch(block_ms)
            except LogError as exc:
                self.caught_up = False
                metrics.REDIS_ERRORS.labels("follow").inc()
                pause = self.backoff.next_pause(exc)  # past the outage limit: OutageExceeded
                if timeout is not None:
                    pause = min(pause, timeout)
                logger.warning("following %s failed, retrying in %.1f s: %s",
                               self.stream, pause, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), pause)
                return []
            self.backoff.reset()
            return folded

    async def _fetch(self, block_ms: int) -> list[Envelope]:
        """One read past the position, folded; ``caught_up`` says whether it reached the
        stream's end."""
        if self._snapshots:
            await self._reseat()
        envs, position = await self.log.read_after(
            self.stream, self.position, block_ms=block_ms, count=_PAGE, dead_letter=self.owner
        )
        self.caught_up = len(envs) < _PAGE
        return self.apply(envs, at_least=position)

    async def run(self) -> None:
        """Read until ``close()`` (or ``until`` holds); waiters wake on every change."""
        self._following = True
        try:
            while not self.closed and not self.done:
                await self.read()
        finally:
            self._following = False
            self._wake()  # a waiter reads itself from now on

    async def changed(self, since: int, timeout: float | None = None) -> None:
        """Return once ``version`` is past ``since`` (at once if it is already), or after
        ``timeout`` seconds; ``FollowerClosed`` once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.version == since and not self.closed:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if self._following or self.done:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), left)
            else:
                await self.read(left)
        if self.closed:
            raise FollowerClosed(f"the follower of {self.stream} is closed")

    async def wait_for(
        self, predicate: Callable[[S], bool], timeout: float | None = None, *,
        what: str | None = None,
    ) -> S:
        """The state, once ``predicate`` holds for it; ``TimeoutError`` (``what`` names the
        wait) after ``timeout`` seconds; ``FollowerClosed`` once closed. While ``run``
        follows, the state is the stream's and a predicate that holds returns at once. A
        waiter that reads itself first reads to the stream's end, and decides only on a
        read that reached it: it never acts on a state the rest of the stream changed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fresh = self._following
        while True:
            if self.closed:
                raise FollowerClosed(f"the follower of {self.stream} is closed")
            state = self.state
            if fresh and predicate(state):
                return state
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{what or f'waiting on {self.stream}'} after {timeout} s")
            if self._following or self.done:
                fresh = True
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), left)
            else:
                await self.read(left, block=fresh)
                fresh = self.caught_up

    def close(self) -> None:
        """Waiters raise ``FollowerClosed``; ``run`` ends after its current read."""
        self._stopped.set()
        self._wake()


def _past(envelopes: Sequence[Envelope], position: str) -> list[Envelope]:
    """The envelopes (in stream order) after ``position``."""
    key = parse_id(position)
    for at, env in enumerate(envelopes):
        if parse_id(env.id) > key:
            return envelopes if at == 0 and isinstance(envelopes, list) else list(envelopes[at:])
    return []


@contextlib.asynccontextmanager
async def following(stop: asyncio.Event, *followers: Follower[Any]) -> AsyncIterator[asyncio.Event]:
    """Run each follower's ``run`` beside the body. Yields ``halt``, set once ``stop`` is or a
    follower ended; a follower's failure (``OutageExceeded``) is raised after the body. On
    exit every follower is closed and awaited (it ends after its current read)."""
    loop = asyncio.get_running_loop()
    halt = asyncio.Event()
    tasks = [loop.create_task(f.run(), name=f"follow {f.stream}") for f in followers]
    relay = loop.create_task(stop.wait())
    for task in (*tasks, relay):
        task.add_done_callback(lambda _t: halt.set())
    try:
        yield halt
    finally:
        relay.cancel()
        for f in followers:
            f.close()
        await asyncio.gather(relay, *tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and (failure := task.exception()) is not None:
            raise failure
