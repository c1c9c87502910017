"""Diagnostics events: what the engine tells operators about work that does not move.

They are written beside the domain events (a rollout's on its stream, so ``rollout status``
and ``rollout tail`` show them) but nothing is decided from them: the rollout fold ignores
them, so the samples, the ready decision and a replay are the same with or without them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.events.base import Event

__all__ = ["RolloutStalled"]


class RolloutStalled(Event):
    """The rollout's stream got no new entry for ``idle_s`` seconds (the finalizer's stall
    window): what it waits for, one line per stage that still holds samples, upstream first
    (the plan, admission -- the pool, a staleness bound or a weight sync --, workers to take
    admitted batches, samples running, teacher scores). Appended by the finalizer following
    the rollout, again every window while it stays stalled."""

    type: Literal["RolloutStalled"] = "RolloutStalled"
    rollout_id: str
    idle_s: float
    waiting_for: list[str]
    not_admitted: int = 0  # sealed batches with samples to run that the pool has not placed
    not_started: int = 0  # admitted batches none of whose unfinished samples has started
    running: dict[str, int] = Field(default_factory=dict)  # worker -> samples running
    consumers: dict[str, int] = Field(default_factory=dict)  # work-stream consumer -> idle ms
