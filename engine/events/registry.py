"""The model servers' registry on ``rl:control``: which servers serve, for which role.

A supervisor (``rollout serve``) appends ``ServerRegistered`` each time a server it runs
answers (at start and after every restart) and ``ServerRetired`` when it stops one for good;
workers and the syncer fold them (``engine.projections.control``) to find the servers
instead of reading them from flags.
"""

from __future__ import annotations

from typing import Literal

from engine.events.base import Event

__all__ = ["ServerRegistered", "ServerRetired", "ServerRole"]

ServerRole = Literal["policy", "teacher"]


class ServerRegistered(Event):
    """``endpoint`` (a base URL) serves ``role`` with ``backend`` (``tinylm``, ``sglang``),
    started by ``supervisor`` at ``weight_version`` (the policy version it loaded; None for
    a teacher). A later one for the same endpoint replaces it (a restart)."""

    type: Literal["ServerRegistered"] = "ServerRegistered"
    endpoint: str
    role: ServerRole = "policy"
    backend: str
    supervisor: str
    weight_version: int | None = None
    pid: int | None = None


class ServerRetired(Event):
    """``endpoint`` was stopped for good by ``supervisor`` (``reason`` says why)."""

    type: Literal["ServerRetired"] = "ServerRetired"
    endpoint: str
    supervisor: str
    reason: str = ""
