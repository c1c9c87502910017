"""The engine's agent loop for verl 0.9 (``AgentLoopBase``), registered as ``rollout_engine``.

Import this module where verl runs (verl's own imports: Ray, Hydra, tensordict, ...), or name
``integrations.verl_agent_loop.EngineAgentLoop`` in an ``agent_loop_config_path`` file; rows
whose ``agent_name`` is ``rollout_engine`` then run on the engine. Each run is one engine
sample (``integrations.verl``): the ``rollout.n`` runs of a ``uid`` share one engine rollout,
on the engine's settings (``ROLLOUT_REDIS_URL``, ...); a row's ``engine_datasets`` (a list of
dataset names), when present, picks the engine datasets of its group.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register

from engine.client import RolloutClient
from integrations.verl import AGENT_NAME, EngineGroups, agent_loop_fields

__all__ = ["EngineAgentLoop"]

_GROUPS: dict[int, EngineGroups] = {}
"""One ``EngineGroups`` per event loop: verl instantiates a loop per run, and the runs of a
step share the worker's event loop."""


@register(AGENT_NAME)
class EngineAgentLoop(AgentLoopBase):  # type: ignore[misc]
    """An agent loop whose trajectory is an engine sample (see the module docstring)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        import asyncio

        loop = id(asyncio.get_running_loop())
        groups = _GROUPS.get(loop)
        if groups is None:
            groups = _GROUPS[loop] = EngineGroups(RolloutClient.connect(producer="verl"))
        datasets = kwargs.get("engine_datasets")
        rid, sample = await groups.sample(
            kwargs, int(self.rollout_config.n),
            datasets=[str(d) for d in datasets] if datasets is not None else None)
        fields = agent_loop_fields(sample, rollout_id=rid,
                                   response_length=int(self.rollout_config.response_length))
        return AgentLoopOutput(**fields)
