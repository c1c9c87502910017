"""The binding of an evaluator profile to the agent that runs its samples.

Profiles are pure data (the scheduler never builds an agent); only an evaluator worker binds
the profiles it serves to live agents, so the binding lives beside the agents, not in the domain.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.agents.base import BaseAgent
from engine.domain import EvaluatorProfile
from engine.errors import ConfigError

__all__ = ["EvaluatorBinding"]


@dataclass(frozen=True, slots=True)
class EvaluatorBinding:
    """A profile and the agent that runs the samples of its batches."""

    profile: EvaluatorProfile
    agent: BaseAgent

    def __post_init__(self) -> None:
        if not isinstance(self.profile, EvaluatorProfile):
            raise ConfigError(
                f"an evaluator binding needs an EvaluatorProfile, got {type(self.profile).__name__}"
            )
        if not isinstance(self.agent, BaseAgent):
            raise ConfigError(
                f"evaluator {self.profile.evaluator_id!r}: the agent must be a BaseAgent, "
                f"got {type(self.agent).__name__}"
            )

    @property
    def evaluator_id(self) -> str:
        return self.profile.evaluator_id
