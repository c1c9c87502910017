"""Scaffold plug-ins for ``InstalledAgent`` (the port is ``base``): ``MiniSweAgent`` runs
mini-swe-agent from PyPI; ``OpenHandsRules`` and ``Terminus2Rules`` are those scaffolds'
termination precedence."""

from engine.agents.scaffolds.base import (
    OpenHandsRules,
    Scaffold,
    ScaffoldExit,
    ScaffoldInvocation,
    ScaffoldReport,
    ScaffoldRun,
    Terminus2Rules,
    base_termination,
)
from engine.agents.scaffolds.mini_swe_agent import MiniSweAgent, mini_swe_agent_reason

__all__ = [
    "MiniSweAgent",
    "OpenHandsRules",
    "Scaffold",
    "ScaffoldExit",
    "ScaffoldInvocation",
    "ScaffoldReport",
    "ScaffoldRun",
    "Terminus2Rules",
    "base_termination",
    "mini_swe_agent_reason",
]
