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
- ``open()`` lets the waiting calls go;
- ``interrupt()`` (on a closed gate) aborts the *resumable* generate calls in flight, by
  their exact rids on their servers, instead of waiting for them: the server answers each
  with the tokens sampled so far, the call is marked ``interrupted``, and the caller that
  made it resumable (a bound view of the ``BackendPool``) continues the turn from those
  tokens once the gate opens again. The aborts are sent again every ``ABORT_EVERY_S`` while
  such a call is still in flight and the gate closed: SGLang drops an abort whose rid it does
  not hold yet (``TokenizerManager.abort_request``), which happens when the request is still
  on its way. Other calls (a score, a chat call, a forwarded one) are waited for, and so is
  a call whose server refuses the abort (401/403: a server started with an admin key keeps
  ``/abort_request`` for that key, which workers do not hold; docs/security.md).

The gate is asyncio-only (one event loop, the worker's); it holds no lock across an await,
so a cancelled call never leaves it counting a call that is not running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from engine.backends.hooks import CallKind, ModelCall
from engine.errors import BackendHTTPError

__all__ = ["ABORT_EVERY_S", "TurnGate"]

logger = logging.getLogger(__name__)

ABORT_EVERY_S = 0.25
_ABORT_TIMEOUT_S = 5.0


class TurnGate:
    """See the module docstring."""

    def __init__(self) -> None:
        self._opened = asyncio.Event()
        self._opened.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._in_flight = 0
        self._resumable: set[ModelCall] = set()  # in flight, abortable, continued by the caller
        self._aborting: asyncio.Task[None] | None = None
        self.reason = ""
        self.interrupted = 0  # calls interrupted so far

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

    def interrupt(self) -> None:
        """Abort the resumable calls in flight, while the gate stays closed (module
        docstring)."""
        if self.is_open:
            return
        for call in self._resumable:
            if not call.interrupted:
                call.interrupted = True
                self.interrupted += 1
        if self._resumable and (self._aborting is None or self._aborting.done()):
            self._aborting = asyncio.ensure_future(self._abort_interrupted())

    async def _abort_interrupted(self) -> None:
        while not self.is_open:
            calls = [c for c in self._resumable if c.interrupted]
            if not calls:
                return
            for call in calls:
                try:
                    async with asyncio.timeout(_ABORT_TIMEOUT_S):
                        await call.backend.abort(call.rid)
                except BackendHTTPError as exc:
                    if exc.status not in (401, 403):
                        continue
                    # The server keeps /abort_request for its admin key, which workers do
                    # not hold: this call is waited for, as without interrupting.
                    call.interrupted = False
                    self.interrupted -= 1
                    logger.warning("cannot interrupt %s on %r for the sync (%s): waiting for "
                                   "it instead", call.rid, call.backend, exc)
                except Exception as exc:  # tried again, unless the call ends meanwhile
                    logger.debug("abort of %s on %r failed: %r", call.rid, call.backend, exc)
            await asyncio.sleep(ABORT_EVERY_S)

    async def wait_open(self) -> None:
        """Return once the gate is open (at once when it is)."""
        while not self._opened.is_set():
            await self._opened.wait()

    async def drained(self) -> None:
        """Return once no call is in flight (at once when none is)."""
        while self._in_flight:
            self._idle.clear()
            await self._idle.wait()

    async def before(self, call: ModelCall | None = None) -> None:
        """Wait for the gate to be open, then count the call as in flight."""
        await self.wait_open()
        self._in_flight += 1
        if (
            call is not None
            and call.resumable
            and call.kind is CallKind.GENERATE
            and call.rid is not None
            and call.backend.capabilities.abort
        ):
            self._resumable.add(call)

    def after(self, call: ModelCall | None = None, result: Any = None, error: Any = None) -> None:
        """The call counted by ``before`` ended."""
        if call is not None:
            self._resumable.discard(call)
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
