"""The episode window: one time budget for a sample's ``init``, ``run`` and ``eval``.

The window is ``StoppingCriteria.timeout_s`` of the sample's ``TaskFetched`` (None: no
window). It covers the three phases, not the wait for a placement token: the attempt record
(``Attempt.used_s``) adds up the time each phase took. A phase that would start with nothing
left, or that is still running when the window elapses (it is cancelled then), raises
``EpisodeTimeout`` naming the phase; the sample is aborted as ``agent_timeout``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from engine.actors.outcomes import Attempt
from engine.errors import EpisodeTimeout

__all__ = ["check_left", "timed", "within_window"]

T = TypeVar("T")


def check_left(rec: Attempt) -> None:
    """``EpisodeTimeout`` when nothing of the window is left before phase ``rec.phase``."""
    window = rec.window_s
    if window is not None and window - rec.used_s <= 0:
        raise EpisodeTimeout(f"episode window of {window:g} s elapsed before {rec.phase}")


async def timed(
    step: Coroutine[Any, Any, T],
    rec: Attempt,
    clock: Callable[[], float],
    *,
    scoped: bool = True,
) -> T:
    """Await one phase within what is left of the window, adding its time to ``rec``
    (``scoped=False``: a phase known to return at once, timed without a timeout scope)."""
    try:
        check_left(rec)
    except EpisodeTimeout:
        step.close()
        raise
    start = clock()
    try:
        if rec.window_s is None or not scoped:
            return await step
        return await within_window(step, rec)
    finally:
        rec.used_s += clock() - start


async def within_window(step: Coroutine[Any, Any, T], rec: Attempt) -> T:
    """Await ``step`` under one timeout scope of what is left of the window (which must be
    set); its expiry is an ``EpisodeTimeout`` naming the phase it cut (``rec.phase`` then)."""
    window = rec.window_s
    assert window is not None
    cm = asyncio.timeout(window - rec.used_s)
    try:
        async with cm:
            return await step
    except TimeoutError:
        if cm.expired():
            raise EpisodeTimeout(
                f"episode window of {window:g} s elapsed during {rec.phase}"
            ) from None
        raise
