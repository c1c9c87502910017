"""``ControlWatch``: ``rl:control`` as one evaluator worker follows it.

The worker follows the stream in a task of its own (a blocking read): the trainer's published
policy version and the tails of over-provisioned rollouts that became ready. Every
``BatchRun`` of the worker reads them before each sample and each turn (``SampleGuard``).
"""

from __future__ import annotations

import asyncio
import logging

from engine.events.log import EMPTY_ID, EventLog
from engine.projections.rollout import ControlProjection
from engine.runtime.live import LiveFold

__all__ = ["ControlWatch"]

logger = logging.getLogger(__name__)


class ControlWatch:
    """See the module docstring; ``wait_changed`` returns whenever something new was folded."""

    def __init__(self, log: EventLog, *, block_ms: int = 1000) -> None:
        self._fold = LiveFold(log, log.names.control, ControlProjection())
        self._log = log
        self._block_ms = block_ms
        self._changed = asyncio.Event()
        self._ready = asyncio.Event()

    @property
    def published(self) -> int | None:
        return self._fold.state.published

    def tail_of(self, rollout_id: str) -> tuple[str, frozenset[str]] | None:
        """``(mode, sample ids)`` of a ready rollout's tail; None: not ready with one."""
        return self._fold.state.tails.get(rollout_id)

    async def wait_changed(self) -> None:
        """Return once the next change has been folded."""
        event = self._changed
        await event.wait()

    async def caught_up(self) -> None:
        """Return once the stream's history has been folded (the first read)."""
        await self._ready.wait()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the stream until ``stop``; a Redis error is retried after a pause."""
        position = EMPTY_ID
        while not stop.is_set():
            try:
                envs, position = await self._log.read_after(
                    self._log.names.control,
                    position,
                    block_ms=0 if not self._ready.is_set() else self._block_ms,
                    count=2000,
                )
            except Exception as exc:  # a transient outage: the next read retries
                logger.warning("control watch: read failed (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            if envs:
                self._fold.apply(envs)
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()
            if not envs and not self._ready.is_set():
                self._ready.set()
