"""Episode handlers: the ``BaseAgent`` contract (``base``), the records an episode hands back
(``result``), the binding of an evaluator profile to its agent (``binding``) and the native
tool agent. Names are imported lazily, so importing ``engine.agents.result`` (the sample path
does) does not pull in the backends and sandboxes ``base`` types its context with.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "AgentResult": "engine.agents.result",
    "Reward": "engine.agents.result",
    "TurnRecord": "engine.agents.result",
    "UNKNOWN_VERSION": "engine.agents.result",
    "BaseAgent": "engine.agents.base",
    "Episode": "engine.agents.base",
    "EpisodeAgent": "engine.agents.base",
    "EpisodeContext": "engine.agents.base",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'engine.agents' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
