"""The actor loop every consumer-group actor runs: fetch, handle, ack; hand back on stop.

``serve(consumer, stop, handle, ...)`` is the whole shell of the scheduler, the evaluator
worker, the finalizer and the capture worker; each brings only ``handle`` (its fold,
decision and effects for one delivery) and, where a dead entry stands for work to abort,
``on_dead``.

* Up to ``capacity`` deliveries are handled at once, each in its own task; the loop fetches
  only as many as are free (``None``: no bound, a fetch takes up to ``FETCH_COUNT``), so the
  rest wait in the group for another consumer.
* ``handle(d)`` returning means its effects are recorded (the handler flushes its appends
  first): the delivery is acked (an ack that cannot reach Redis is retried, not dropped).
  Raising :class:`HandBack` (the actor is stopping and the work is unfinished) hands it
  back. Any other exception is logged and the delivery is released: it stays pending and is
  claimed after the idle window, as a further delivery (so an entry that always fails ends
  dead-lettered). Before a release, ``settle_writes`` runs (e.g. flush what the handler
  queued): work is never given up while events for it are still to be written. Raising
  :class:`LeaseLost` (the handler found the work taken over under a newer lease) drops the
  delivery: it is neither acked nor released, since it is no longer this consumer's.
* A transport error is not a failed delivery: when ``handle`` raises
  :class:`~engine.errors.LogUnavailable` the delivery stays this consumer's (in flight, kept
  alive by the heartbeat once Redis answers), and ``handle`` runs again, as a redelivery
  (``redelivered=True``: it resumes from the log), after the consumer's backoff pause.
* Redis unreachable for longer than the backoff's outage limit (reading, or re-running a
  handler) raises :class:`~engine.errors.OutageExceeded` out of ``serve``: the process is
  meant to exit with it.
* Dead entries go to ``on_dead`` and are settled once it returned (see
  ``GroupConsumer.handle_dead``); without ``on_dead`` they are only settled.
* Stop: no new fetch; ``on_stopping`` runs (e.g. close a gate so waiting handlers give up);
  running handlers get ``grace_s`` seconds (``None``: as long as they take); the rest are
  cancelled; ``before_hand_back`` runs (e.g. flush what the finished work emitted); then
  every unfinished delivery, and every entry read but not handed out yet, is handed back
  (claimable at once, not counted as a delivery).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine import metrics
from engine.errors import LogError, LogUnavailable, OutageExceeded
from engine.events.ids import id_ms
from engine.events.log import DeadEntry
from engine.runtime.consumer import Delivery, GroupConsumer, ride_out

__all__ = [
    "FETCH_COUNT", "GC_THRESHOLD", "HandBack", "LeaseLost", "Served", "serve", "tune_gc",
]

GC_THRESHOLD = (10_000, 20, 100)
"""The cyclic collector's thresholds in an actor process. Actors keep large, long-lived,
acyclic folds (a finalizer follows 100k-sample rollouts) and allocate many short-lived
events: with Python's defaults (700, 10, 10) the collector scans the whole fold over and
over, which cost more than the fold itself and grew with the rollout (a 100k-sample fold
took 96 us per sample against 68 us at 10k; with these thresholds 40 us at both). Garbage is
still collected, only in larger steps."""


def tune_gc() -> None:
    """Raise the collector's thresholds to at least :data:`GC_THRESHOLD` (never lowers a
    threshold a process set itself)."""
    current = gc.get_threshold()
    gc.set_threshold(*(max(c, t) for c, t in zip(current, GC_THRESHOLD, strict=True)))

logger = logging.getLogger(__name__)

FETCH_COUNT = 100

Handler = Callable[[Delivery], Awaitable[None]]
DeadHandler = Callable[[DeadEntry], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]


class HandBack(Exception):  # noqa: N818 -- a signal, not an error
    """Raised by a handler that stops work on its delivery because the actor is stopping:
    the delivery is handed back instead of released."""


class LeaseLost(Exception):  # noqa: N818 -- a signal, not an error
    """Raised by a handler that finds its delivery taken over by another consumer under a
    newer lease: the work is not done here, and the delivery is dropped (not acked)."""


@dataclass(slots=True)
class Served:
    """What one ``serve`` did, for the actor's counters."""

    handled: int = 0
    failed: int = 0
    handed_back: int = 0


async def serve(
    consumer: GroupConsumer,
    stop: asyncio.Event,
    handle: Handler,
    *,
    on_dead: DeadHandler | None = None,
    capacity: int | None = None,
    grace_s: float | None = 0.0,
    on_stopping: Hook | None = None,
    before_hand_back: Hook | None = None,
    settle_writes: Hook | None = None,
) -> Served:
    """Run the actor loop until ``stop`` is set (see the module docstring)."""
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    tune_gc()
    hooks = _Hooks(on_dead or _nothing, on_stopping, before_hand_back, settle_writes)
    return await _Loop(consumer, handle, hooks, capacity, grace_s).run(stop)


@dataclass(frozen=True, slots=True)
class _Hooks:
    on_dead: DeadHandler
    on_stopping: Hook | None
    before_hand_back: Hook | None
    settle_writes: Hook | None


class _Loop:
    """One ``serve``: its deliveries in flight, what it hands back, and its stop."""

    def __init__(
        self,
        consumer: GroupConsumer,
        handle: Handler,
        hooks: _Hooks,
        capacity: int | None,
        grace_s: float | None,
    ) -> None:
        self.consumer = consumer
        self.handle = handle
        self.hooks = hooks
        self.capacity = capacity
        self.grace_s = grace_s
        self.served = Served()
        self.handed: list[Delivery] = []  # unfinished work to hand back at the stop
        self.active: dict[asyncio.Task[None], Delivery] = {}
        self.lost: set[tuple[str, str]] = set()  # cancelled: another consumer owns them
        self.halt = asyncio.Event()  # the stop, or a fatal outage in a handler
        self.fatal: list[OutageExceeded] = []

    async def run(self, stop: asyncio.Event) -> Served:
        consumer = self.consumer
        consumer.on_lost = self.on_lost

        async def relay() -> None:
            await stop.wait()
            self.halt.set()

        loop = asyncio.get_running_loop()
        try:
            await ride_out(
                consumer.start, consumer.backoff, what="creating the consumer groups", stop=stop
            )
        except LogUnavailable:
            if not stop.is_set():
                raise
            await consumer.aclose()  # stopped while Redis was away: nothing was taken
            return self.served
        relay_task = loop.create_task(relay())
        stop_wait = loop.create_task(self.halt.wait())
        try:
            await self.fetch_until_halted(stop_wait)
            await self.wind_down()
        finally:
            stop_wait.cancel()
            relay_task.cancel()
            for task in self.active:
                task.cancel()
            await asyncio.gather(*self.active, return_exceptions=True)
            await consumer.aclose()
        return self.served

    async def fetch_until_halted(self, stop_wait: asyncio.Task[bool]) -> None:
        """Fetch as many deliveries as there is room for and start a task for each."""
        consumer, loop = self.consumer, asyncio.get_running_loop()
        while not self.halt.is_set():
            for task in [t for t in self.active if t.done()]:
                del self.active[task]
            free = FETCH_COUNT if self.capacity is None else self.capacity - len(self.active)
            if free <= 0:
                await asyncio.wait([*self.active, stop_wait], return_when=FIRST_COMPLETED)
                continue
            fetched = await consumer.fetch_or_stop(free, stop_wait)
            if fetched is None:
                return
            deliveries, dead = fetched
            if dead:
                metrics.DEAD_LETTERS.labels(consumer.group).inc(len(dead))
                await consumer.handle_dead(dead, self.hooks.on_dead)
            for d in deliveries:
                metrics.delivered(consumer.group, d.env.stream, id_ms(d.env.id),
                                  redelivered=d.redelivered)
                task = loop.create_task(self.run_one(d), name=f"{consumer.group}-{d.env.id}")
                self.active[task] = d

    def on_lost(self, d: Delivery) -> None:
        """Another consumer owns ``d`` now: stop its handler, give nothing back."""
        for task, held in self.active.items():
            if held.key == d.key and not task.done():
                self.lost.add(d.key)
                task.cancel()

    async def run_one(self, d: Delivery) -> None:
        try:
            await self.attempt(d)
        except OutageExceeded as exc:
            self.fatal.append(exc)
            self.halt.set()
        except asyncio.CancelledError:
            if d.key not in self.lost:
                raise
            self.lost.discard(d.key)
            self.served.failed += 1

    async def attempt(self, d: Delivery) -> None:
        """Handle ``d`` until it is done, handed back or failed (module docstring)."""
        consumer = self.consumer
        backoff = dataclasses.replace(consumer.backoff, failures=0, failing_since=None)
        while True:
            try:
                await self.handle(d)
                break
            except HandBack:
                self.handed.append(d)
                return
            except LeaseLost as exc:
                logger.warning("%s: %s", consumer.consumer, exc)
                consumer.release(d)  # no longer ours: only stop keeping it alive
                self.served.failed += 1
                return
            except LogUnavailable as exc:
                metrics.REDIS_ERRORS.labels("handler").inc()
                if self.halt.is_set():
                    self.handed.append(d)  # stopping: the work is unfinished
                    return
                pause = backoff.next_pause(exc)
                logger.error(
                    "%s: entry %s of %s lost Redis, running it again in %.1f s: %s",
                    consumer.consumer, d.env.id, d.env.stream, pause, exc,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.halt.wait(), pause)
                d = dataclasses.replace(d, redelivered=True)
            except Exception as exc:
                self.served.failed += 1
                logger.error(
                    "%s: entry %s of %s failed, left pending for a retry: %r",
                    consumer.consumer, d.env.id, d.env.stream, exc, exc_info=exc,
                )
                if self.hooks.settle_writes is not None:
                    await ride_out(self.hooks.settle_writes, consumer.backoff,
                                   what="writing its events")
                consumer.release(d)
                return
        # Its effects are recorded; an ack is idempotent, so it is retried through an outage.
        await ride_out(lambda: consumer.ack(d), consumer.backoff, what=f"ack of {d.env.id}")
        self.served.handled += 1

    async def wind_down(self) -> None:
        """The stop: let running handlers finish within the grace period, cancel the rest,
        then hand back every unfinished delivery (or leave them pending, module doc)."""
        consumer = self.consumer
        if self.hooks.on_stopping is not None:
            await self.hooks.on_stopping()
        if self.active:
            _done, late = await asyncio.wait(list(self.active), timeout=self.grace_s)
            for task in late:
                task.cancel()
                if self.active[task].key not in self.lost:
                    self.handed.append(self.active[task])
            await asyncio.gather(*late, return_exceptions=True)
        if self.fatal:
            raise self.fatal[0]
        unfinished = [*self.handed, *consumer.take_backlog()]
        if self.hooks.before_hand_back is not None:
            try:
                await self.hooks.before_hand_back()
            except LogError as exc:
                # Events for the unfinished work may still be queued: giving it back now
                # would let another consumer run it beside our late writes. Left pending
                # instead (claimed after the idle window, like a crashed consumer's).
                logger.error(
                    "%s: writing before the hand-back failed, %d entries left pending: %s",
                    consumer.consumer, len(unfinished), exc,
                )
                for d in unfinished:
                    consumer.release(d)
                unfinished = []
        self.served.handed_back = len(self.handed)
        await consumer.hand_back(unfinished)


async def _nothing(entry: DeadEntry) -> None:
    """Dead entries of an actor with nothing to abort are only settled."""
