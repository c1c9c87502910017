"""The registered model servers, folded from ``ServerRegistered`` / ``ServerRetired`` on
``rl:control`` (others pass): endpoint -> its last registration, retired ones removed."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from engine.events.base import Envelope
from engine.events.registry import ServerRegistered, ServerRetired, ServerRole

__all__ = ["RegistryProjection", "RegistryState", "registered_servers"]

RegistryState = Mapping[str, ServerRegistered]
"""Endpoint -> its last registration, in the order the endpoints were first registered."""


class RegistryProjection:
    name = "servers"

    def initial(self) -> RegistryState:
        return MappingProxyType({})

    def evolve(self, state: RegistryState, env: Envelope) -> RegistryState:
        ev = env.event
        if isinstance(ev, ServerRegistered):
            return MappingProxyType({**state, ev.endpoint: ev})
        if isinstance(ev, ServerRetired) and ev.endpoint in state:
            return MappingProxyType({k: v for k, v in state.items() if k != ev.endpoint})
        return state


def registered_servers(state: RegistryState, role: ServerRole = "policy") -> list[str]:
    """The endpoints serving ``role``, in registration order."""
    return [endpoint for endpoint, reg in state.items() if reg.role == role]
