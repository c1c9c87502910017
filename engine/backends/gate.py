"""``TurnGate``: whether a worker may start a generate call now, and how many are in flight.

A weight sync must land between turns, never inside one (a turn is one generate call: its
tokens all come from one set of weights). Every generate call of a worker's policy backends
passes through the worker's one gate (``BackendPool`` installs it on each ``SGLangBackend``
it builds, and the recording proxy's pass-through uses the same gate):

- ``turn()`` waits while the gate is closed, then counts the call as in flight until it
  returns (or fails, or is cancelled);
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

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """One generate call: waits for the gate to be open, then counts as in flight."""
        while not self._opened.is_set():
            await self._opened.wait()
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()
