"""verl's agent loop over the engine: the shapes, and the groups its runs share.

verl 0.9 runs one agent loop per trajectory (``verl/experimental/agent_loop/agent_loop.py``,
``AgentLoopWorker.generate_sequences``): the trainer gives each prompt a ``uid`` and repeats
it ``rollout.n`` times, the worker instantiates the loop registered under the row's
``agent_name`` (``register(agent_name)``, or an ``agent_loop_config_path`` entry) and awaits
``run(sampling_params, **row)``, which returns an ``AgentLoopOutput``: ``prompt_ids``,
``response_ids`` (model and tool tokens), ``response_mask`` (1 on model tokens, 0 on tool
output), ``response_logprobs``, ``reward_score`` (set: verl's reward loop is skipped and the
score lands on the last response token as ``rm_scores``), ``num_turns``, ``metrics``
(``AgentLoopMetrics``) and ``extra_fields`` (``_postprocess`` keeps every key, defaulting
``turn_scores``, ``tool_rewards``, ``min_global_steps``, ``max_global_steps``, ``extras``;
the fully-async trainer reads ``min_global_steps`` / ``max_global_steps`` as the weight
versions a trajectory was sampled across).

Here a trajectory is an engine sample: :func:`agent_loop_fields` gives the output's fields for
one, with the engine's loss mask as ``response_mask``, its reward as ``reward_score``, the
per-token versions in ``extra_fields["token_versions"]`` and their span as
``min_global_steps`` / ``max_global_steps``. ``EngineGroups`` makes the ``rollout.n`` runs
of one ``uid`` share one engine rollout (one prompt, ``n`` samples: one GRPO group in both
systems): the first run of a ``uid`` asks it, each run takes the next sample.
``integrations.verl_agent_loop`` holds the ``AgentLoopBase`` subclass, registered as
``rollout_engine`` (the ``agent_name`` a row routes to), for processes where verl imports.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.client import RolloutClient
from engine.projections.samples import scalar_reward
from engine.sample import Sample

__all__ = ["AGENT_NAME", "EngineGroups", "agent_loop_fields", "turns_of"]

AGENT_NAME = "rollout_engine"
"""The name the engine's agent loop is registered under: rows whose ``agent_name`` is this
run on the engine."""


def turns_of(sample: Sample) -> int:
    """verl's ``num_turns`` (user, assistant and tool turns): the prompt, then each run of
    model tokens and each run of tool output in the response."""
    runs = 0
    last: int | None = None
    for m in sample.loss_mask.tolist():
        if m != last:
            runs += 1
            last = m
    return 1 + runs


def agent_loop_fields(
    sample: Sample, *, rollout_id: str = "", response_length: int | None = None
) -> dict[str, Any]:
    """``AgentLoopOutput``'s fields for ``sample`` (see the module docstring); the response
    arrays are cut to ``response_length`` (verl's ``rollout.response_length``) when given."""
    cut = len(sample.tokens) - sample.response_length
    tokens = sample.tokens.tolist()
    end = sample.response_length if response_length is None else response_length
    versions = sample.token_versions.tolist()[:end] if sample.token_versions is not None else []
    known = [v for v in versions if v >= 0]
    version = sample.policy_version if sample.policy_version is not None else -1
    return {
        "prompt_ids": tokens[:cut],
        "response_ids": tokens[cut:][:end],
        "response_mask": [int(m) for m in sample.loss_mask.tolist()[:end]],
        "response_logprobs": (None if sample.rollout_log_probs is None
                              else [float(x) for x in sample.rollout_log_probs.tolist()[:end]]),
        "reward_score": 0.0 if sample.remove_sample else scalar_reward(sample.reward),
        "num_turns": turns_of(sample),
        "metrics": {},
        "extra_fields": {
            "turn_scores": [],
            "tool_rewards": [],
            "min_global_steps": min(known) if known else version,
            "max_global_steps": max(known) if known else version,
            "token_versions": versions,
            "engine_rollout_id": rollout_id,
            "engine_sample_id": sample.sample_id,
            "engine_status": sample.status.value,
            "engine_removed": sample.remove_sample,
        },
    }


@dataclass
class _Group:
    rollout: asyncio.Task[tuple[str, list[Sample]]]
    taken: int = 0


@dataclass
class EngineGroups:
    """The engine rollouts behind a step's agent loop runs, one per ``uid`` (see the module
    docstring). ``request``: extra arguments of every ``RolloutClient.request``."""

    client: RolloutClient
    timeout_s: float | None = 900.0
    request: dict[str, Any] = field(default_factory=dict)
    _groups: dict[str, _Group] = field(default_factory=dict)

    async def _rollout(
        self, n: int, seed: int, datasets: list[str] | None
    ) -> tuple[str, list[Sample]]:
        state = await self.client.policy_state()
        version = state.activated.version if state.activated is not None else 0
        extra: dict[str, Any] = {**self.request, **({"datasets": datasets} if datasets else {})}
        rid = await self.client.request(
            iteration=version, n_prompts=1, n_samples_per_prompt=n, policy_version=version,
            seed=seed, **extra)
        _ready, samples = await self.client.wait_load(rid, timeout=self.timeout_s)
        return rid, sorted(samples, key=lambda s: s.index)

    async def sample(
        self, row: Mapping[str, Any], n: int, *, datasets: list[str] | None = None
    ) -> tuple[str, Sample]:
        """The next sample of the rollout of ``row``'s group (``uid``, else ``index``): the
        first run of a group asks for a rollout of ``n`` samples (from ``datasets``, when
        given), each run takes one."""
        key = str(row.get("uid", row.get("index")))
        group = self._groups.get(key)
        if group is None:
            seed = zlib.crc32(key.encode())  # the same uid samples the same way
            group = self._groups[key] = _Group(
                asyncio.ensure_future(self._rollout(n, seed, datasets)))
        k = group.taken
        group.taken += 1
        if group.taken >= n:
            del self._groups[key]  # every run of the group has its sample
        rid, samples = await asyncio.shield(group.rollout)
        if k >= len(samples):
            raise IndexError(
                f"group {key}: run {k + 1} of {n}, and its rollout {rid} has {len(samples)} "
                "samples (rollout.n must equal the engine's samples per prompt)"
            )
        return rid, samples[k]
