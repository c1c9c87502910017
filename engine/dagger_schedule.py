"""``DAggerSchedule``: the per-iteration DAgger knobs, from the iteration number alone.

The trainer (the only party that knows the iteration) builds one schedule and puts
``schedule.knobs(iteration)`` into each training rollout request's ``knobs``; they reach every
episode as ``EpisodeContext.dagger_beta`` / ``t_max``.

``beta`` (the probability the teacher executes a turn) decays from ``beta_start`` to
``beta_end``:

- ``linear``: ``start + (end - start) * p``, with ``p = min(iteration / decay_iterations, 1)``;
- ``cosine``: ``end + (start - end) * (1 + cos(pi * p)) / 2``;
- ``exp``: ``start * gamma ** iteration``, never below ``end``;
- ``step``: ``start * gamma ** (iteration // step_iterations)``, never below ``end``.

``t_max`` (the turns the teacher may act in) ramps linearly: ``t_max_start + t_max_step *
iteration``, capped at ``t_max_cap`` when one is set. The guard: with ``t_max_step == 0`` the
schedule publishes no ``t_max`` at all, so a statically configured one is not clobbered by a
ramp that does not exist (a ``t_max`` of 0 would silence the teacher).

Eval runs student-only: the engine gives an eval request's episodes no ``dagger_beta`` (an
episode without one never asks the teacher) unless the request sets ``eval_dagger_beta``;
``eval_knobs`` turns training knobs into an eval request's (``dagger_beta`` popped,
``eval_beta`` re-injected as ``eval_dagger_beta`` when given).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import ConfigError

__all__ = ["BetaDecay", "DAggerSchedule", "eval_knobs"]

BetaDecay = Literal["linear", "cosine", "exp", "step"]
_DECAYS = ("linear", "cosine", "exp", "step")


@dataclass(frozen=True, kw_only=True)
class DAggerSchedule:
    """Beta decay and the ``t_max`` ramp (see the module docstring)."""

    beta_start: float = 1.0
    beta_end: float = 0.0
    decay: BetaDecay = "linear"
    decay_iterations: int = 10
    gamma: float = 0.5
    step_iterations: int = 1
    t_max_start: int = 0
    t_max_step: int = 0
    t_max_cap: int | None = None

    def __post_init__(self) -> None:
        for name in ("beta_start", "beta_end"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"DAggerSchedule.{name} must be within [0, 1], got {value}")
        if self.beta_end > self.beta_start:
            raise ConfigError(
                f"DAggerSchedule: beta decays, so beta_end ({self.beta_end}) must not exceed "
                f"beta_start ({self.beta_start})"
            )
        if self.decay not in _DECAYS:
            raise ConfigError(
                f"DAggerSchedule.decay must be one of {', '.join(_DECAYS)}, got {self.decay!r}"
            )
        for name in ("decay_iterations", "step_iterations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"DAggerSchedule.{name} must be a positive integer, got {value!r}"
                )
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"DAggerSchedule.gamma must be within (0, 1], got {self.gamma}")
        for name in ("t_max_start", "t_max_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"DAggerSchedule.{name} must be a non-negative integer, got {value!r}"
                )
        if self.t_max_cap is not None and self.t_max_cap < self.t_max_start:
            raise ConfigError(
                f"DAggerSchedule.t_max_cap ({self.t_max_cap}) is below t_max_start "
                f"({self.t_max_start})"
            )

    def beta(self, iteration: int) -> float:
        """The teacher's per-turn probability at ``iteration`` (from 0)."""
        _check_iteration(iteration)
        start, end = self.beta_start, self.beta_end
        progress = min(iteration / self.decay_iterations, 1.0)
        if self.decay == "linear":
            value = start + (end - start) * progress
        elif self.decay == "cosine":
            value = end + (start - end) * (1.0 + math.cos(math.pi * progress)) / 2.0
        elif self.decay == "exp":
            value = max(end, start * self.gamma**iteration)
        else:
            value = max(end, start * self.gamma ** (iteration // self.step_iterations))
        return min(start, max(end, value))

    def t_max(self, iteration: int) -> int | None:
        """The ramp's ``t_max`` at ``iteration``; ``None`` when there is no ramp (the guard)."""
        _check_iteration(iteration)
        if self.t_max_step <= 0:
            return None
        value = self.t_max_start + self.t_max_step * iteration
        return value if self.t_max_cap is None else min(value, self.t_max_cap)

    def knobs(self, iteration: int) -> dict[str, Any]:
        """The training request's knobs at ``iteration``: ``dagger_beta``, and ``t_max`` when
        the ramp is on."""
        out: dict[str, Any] = {"dagger_beta": self.beta(iteration)}
        t_max = self.t_max(iteration)
        if t_max is not None:
            out["t_max"] = t_max
        return out


def eval_knobs(knobs: Mapping[str, Any], *, eval_beta: float | None = None) -> dict[str, Any]:
    """``knobs`` for an eval request: ``dagger_beta`` popped (student-only), and
    ``eval_dagger_beta`` set when an ``eval_beta`` is given (the one beta an eval request's
    episodes read; the engine ignores ``dagger_beta`` on eval requests anyway)."""
    out = {k: v for k, v in knobs.items() if k not in ("dagger_beta", "eval_dagger_beta")}
    if eval_beta is not None:
        if not 0.0 <= eval_beta <= 1.0:
            raise ConfigError(f"eval_beta must be within [0, 1], got {eval_beta}")
        out["eval_dagger_beta"] = eval_beta
    return out


def _check_iteration(iteration: int) -> None:
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ConfigError(
            f"DAggerSchedule: iteration must be a non-negative integer, got {iteration!r}"
        )
