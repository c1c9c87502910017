"""The actor loop every consumer-group actor runs: fetch, handle, ack; hand back on stop.

``serve(consumer, stop, handle, ...)`` is the whole shell of the scheduler, the evaluator
worker, the finalizer and the capture worker; each brings only ``handle`` (its fold,
decision and effects for one delivery) and, where a dead entry stands for work to abort,
``on_dead``.

* Up to ``capacity`` deliveries are handled at once, each in its own task; the loop fetches
  only as many as are free (``None``: no bound, a fetch takes up to ``FETCH_COUNT``), so the
  rest wait in the group for another consumer.
* ``handle(d)`` returning means its effects are recorded (the handler flushes its appends
  first): the delivery is acked. Raising :class:`HandBack` (the actor is stopping and the
  work is unfinished) hands it back. Any other exception is logged and the delivery is
  released: it stays pending and is claimed after the idle window, as a further delivery
  (so an entry that always fails ends dead-lettered).
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
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine import metrics
from engine.errors import LogError
from engine.events.ids import id_ms
from engine.events.log import DeadEntry
from engine.runtime.consumer import Delivery, GroupConsumer

__all__ = ["FETCH_COUNT", "HandBack", "Served", "serve"]

logger = logging.getLogger(__name__)

FETCH_COUNT = 100

Handler = Callable[[Delivery], Awaitable[None]]
DeadHandler = Callable[[DeadEntry], Awaitable[None]]
Hook = Callable[[], Awaitable[None]]


class HandBack(Exception):  # noqa: N818 -- a signal, not an error
    """Raised by a handler that stops work on its delivery because the actor is stopping:
    the delivery is handed back instead of released."""


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
) -> Served:
    """Run the actor loop until ``stop`` is set (see the module docstring)."""
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    served = Served()
    handed: list[Delivery] = []
    active: dict[asyncio.Task[None], Delivery] = {}
    loop = asyncio.get_running_loop()

    async def run_one(d: Delivery) -> None:
        try:
            await handle(d)
        except HandBack:
            handed.append(d)
            return
        except Exception as exc:
            served.failed += 1
            logger.error(
                "%s: entry %s of %s failed, left pending for a retry: %r",
                consumer.consumer, d.env.id, d.env.stream, exc, exc_info=exc,
            )
            consumer.release(d)
            return
        try:
            await consumer.ack(d)
        except LogError as exc:  # its effects are recorded: a re-run finds them
            metrics.REDIS_ERRORS.labels("ack").inc()
            logger.error("%s: ack of %s failed: %s", consumer.consumer, d.env.id, exc)
            consumer.release(d)
            return
        served.handled += 1

    await consumer.start()
    stop_wait = loop.create_task(stop.wait())
    try:
        while not stop.is_set():
            for task in [t for t in active if t.done()]:
                del active[task]
            free = FETCH_COUNT if capacity is None else capacity - len(active)
            if free <= 0:
                await asyncio.wait([*active, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                continue
            fetched = await consumer.fetch_or_stop(free, stop_wait)
            if fetched is None:
                break
            deliveries, dead = fetched
            if dead:
                metrics.DEAD_LETTERS.labels(consumer.group).inc(len(dead))
                await consumer.handle_dead(dead, on_dead or _nothing)
            for d in deliveries:
                metrics.delivered(consumer.group, d.env.stream, id_ms(d.env.id),
                                  redelivered=d.redelivered)
                active[loop.create_task(run_one(d), name=f"{consumer.group}-{d.env.id}")] = d
        if on_stopping is not None:
            await on_stopping()
        if active:
            _done, late = await asyncio.wait(list(active), timeout=grace_s)
            for task in late:
                task.cancel()
                handed.append(active[task])
            await asyncio.gather(*late, return_exceptions=True)
        if before_hand_back is not None:
            with contextlib.suppress(LogError):
                await before_hand_back()
        served.handed_back = len(handed)
        await consumer.hand_back([*handed, *consumer.take_backlog()])
    finally:
        stop_wait.cancel()
        for task in active:
            task.cancel()
        await asyncio.gather(*active, return_exceptions=True)
        await consumer.aclose()
    return served


async def _nothing(entry: DeadEntry) -> None:
    """Dead entries of an actor with nothing to abort are only settled."""
