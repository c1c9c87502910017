"""Group commit for an actor's appends: many small emits, few round trips.

``emit`` only queues; one background task writes whatever has queued with one
``append_many``, and the next batch accumulates while that write is in flight, so batches
grow with the load. ``flush()`` returns once everything emitted before it is written; an
actor flushes before it acks, so an acked entry's effects are recorded. Events are written
in emit order (a batch is sent only after the previous one), so an event is never in the
log without those emitted before it.

A failed write keeps its events at the head of the queue and fails the waiting
``flush()`` calls; the next flush retries them. A partly applied batch can be written
twice: every fold ignores duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from engine.events.base import Event
from engine.events.log import EventLog

__all__ = ["GroupAppender"]


class GroupAppender:
    """Queues ``(stream, event)`` pairs and writes them in pipelined batches, in order."""

    def __init__(self, log: EventLog, *, max_batch: int = 2000) -> None:
        self._log = log
        self._max_batch = max_batch
        self._queue: list[tuple[str, Event]] = []
        self._emitted = 0  # events ever emitted
        self._written = 0  # events ever written (a prefix of the emitted ones)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def emit(self, items: Sequence[tuple[str, Event]]) -> None:
        if self._closed:
            raise RuntimeError("GroupAppender is closed")
        if not items:
            return
        self._queue.extend(items)
        self._emitted += len(items)
        self._ensure_task()
        self._wake.set()

    async def flush(self) -> None:
        """Wait until every event emitted so far is written; raise the write's error."""
        target = self._emitted
        if self._written >= target:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        self._ensure_task()
        self._wake.set()
        await fut

    async def aclose(self) -> None:
        """Write what is queued (best effort) and stop the writer task."""
        with contextlib.suppress(Exception):
            await self.flush()
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="group-appender"
            )

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[: self._max_batch]
                try:
                    await self._log.append_many(batch)
                except Exception as exc:  # keep the events; fail their waiters
                    self._fail(exc)
                    break
                del self._queue[: len(batch)]
                self._written += len(batch)
                self._resolve()

    def _resolve(self) -> None:
        keep: list[tuple[int, asyncio.Future[None]]] = []
        for target, fut in self._waiters:
            if target <= self._written:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((target, fut))
        self._waiters = keep

    def _fail(self, exc: Exception) -> None:
        waiters, self._waiters = self._waiters, []
        for _target, fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
