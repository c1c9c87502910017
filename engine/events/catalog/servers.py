"""The model servers on ``rl:control``: their health as workers see it, and their registry.

Each evaluator worker tracks its policy servers (``engine/backends/health.py``) and appends a
change of state when it sees one: ``ServerDown`` (a call could not connect, was cut off or
stalled, or a probe failed), ``ServerUp`` (it answers ``/health_generate`` and reports the
active weight version, or any while none is active) and ``ServerStale`` (it answers but
reports another version: it must be synced before it serves again; the weight syncer reacts
to this one). They go on ``rl:control`` because the readers that act on them already fold
that stream: schedulers pause admission while every policy server is down
(``engine.projections.control``), workers start from the fleet's state when they start, the
syncer's consumer group gets each ``ServerStale`` as work, and ``rollout top`` shows them.
The latest event about an endpoint, from any worker, is the fleet's word on it.

A supervisor (``rollout serve``) appends ``ServerRegistered`` each time a server it runs
answers (at start and after every restart) and ``ServerRetired`` when it stops one for good;
workers and the syncer fold them (``engine.projections.control``) to find the servers
instead of reading them from flags.
"""

from __future__ import annotations

from typing import Literal

from engine.events.base import Event

__all__ = [
    "ServerDown", "ServerRegistered", "ServerRetired", "ServerRole", "ServerStale", "ServerUp",
]


class ServerDown(Event):
    """Worker ``worker`` gives no turn to policy server ``endpoint`` until a probe readmits
    it; ``reason`` names what failed (the call and its error, a stall, the probe)."""

    type: Literal["ServerDown"] = "ServerDown"
    endpoint: str
    worker: str
    reason: str


class ServerUp(Event):
    """Policy server ``endpoint`` takes trajectories of worker ``worker`` again; it reports
    ``weight_version`` (None: unknown, SGLang's "default"), the active version if one is."""

    type: Literal["ServerUp"] = "ServerUp"
    endpoint: str
    worker: str
    weight_version: int | None = None


class ServerStale(Event):
    """Policy server ``endpoint`` answers but reports ``weight_version`` (None: unknown, e.g.
    started without ``--weight-version``) while ``active`` is the active policy version: it
    needs a sync to ``active`` before worker ``worker`` gives it a turn again."""

    type: Literal["ServerStale"] = "ServerStale"
    endpoint: str
    worker: str
    weight_version: int | None = None
    active: int
    reason: str = ""


ServerRole = Literal["policy", "teacher", "eval"]
"""``eval``: a server kept at the version it was started with (the syncer never loads it);
it serves eval requests pinned to that version (``RolloutRequested.pinned_version``)."""


class ServerRegistered(Event):
    """``endpoint`` (a base URL) serves ``role`` with ``backend`` (``tinylm``, ``sglang``),
    started by ``supervisor`` at ``weight_version`` (the policy version it loaded, for an
    eval server the one it keeps; None for a teacher). A later one for the same endpoint
    replaces it (a restart)."""

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
