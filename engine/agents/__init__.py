"""Episode handlers: the ``BaseAgent`` contract and the records it exchanges with the engine."""

from engine.agents.base import (
    AgentResult,
    BaseAgent,
    Episode,
    EpisodeAgent,
    EpisodeContext,
    Reward,
    TurnRecord,
)

__all__ = [
    "AgentResult",
    "BaseAgent",
    "Episode",
    "EpisodeAgent",
    "EpisodeContext",
    "Reward",
    "TurnRecord",
]
