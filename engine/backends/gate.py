"""``TurnGate``: whether a worker may start a model call now, and how many are in flight.

A weight sync must land between turns, never inside one (a turn is one generate call: its
tokens all come from one set of weights). Every model call of a worker's backends passes the
worker's one gate: it is the first hook of the worker's ``BackendPool``
(``engine/backends/hooks.py``), so it brackets each ``generate`` and ``score`` of whatever
backend the pool hands out, and the recording proxy's pass-through (``forwarded_call``):

- ``before(call)`` waits while the gate is closed, then counts the call as in flight until
  ``after`` (the call returned, failed or was cancelled); ``turn()`` is the same pair as a
  context manager;
- ``close(reason)`` lets calls in flight finish and makes new ones wait; ``drained()``
  returns once none is in flight -- the worker is then *parked*: its trajectories wait at a
  turn boundary, with all their state, for the gate to open;
- ``open()`` lets the waiting calls go.

The gate is asyncio-only (one event loop, the worker's); it holds no lock across an await,
so a cancelled call never leaves it counting a call that is not running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from engine.backends.hooks import ModelCall

__all__ = ["TurnGate"]


class TurnGate:
    """See the module docstring."""

    def __init__(self) -> None:
        self._opened = asyncio.Event()
        self._opened.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self.reason = ""

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    @property
    def in_flight(self) -> int:
        """Generate calls started through the gate and not finished yet."""
        return self._in_flight

    def close(self, reason: str = "") -> None:
        """New calls wait from now on; calls in flight run to their end."""
        self.reason = reason
        self._opened.clear()

    def open(self) -> None:
        self.reason = ""
        self._opened.set()

    async def drained(self) -> None:
        """Return once no call is in flight (at once when none is)."""
        while self._in_flight:
            self._idle.clear()
            await self._idle.wait()

    async def before(self, call: ModelCall | None = None) -> None:
        """Wait for the gate to be open, then count the call as in flight."""
        while not self._opened.is_set():
            await self._opened.wait()
        self._in_flight += 1

    def after(self, call: ModelCall | None = None, result: Any = None, error: Any = None) -> None:
        """The call counted by ``before`` ended."""
        self._in_flight -= 1
        if not self._in_flight:
            self._idle.set()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """One call spanned by the caller: ``before``, then ``after`` when the block ends."""
        await self.before()
        try:
            yield
        finally:
            self.after()
