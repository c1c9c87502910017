"""Event-sourced rollout engine for agentic RL training.

Components coordinate only by appending typed events to Redis Streams (docs/architecture.md). The
public API is listed in ``__all__``; names are imported on first use, so ``import engine``
stays cheap (the trainer client pulls in torch, the backends httpx and transformers).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # errors and settings
    "EngineError": "engine.errors",
    "Settings": "engine.settings",
    # the event log
    "EventLog": "engine.events",
    "MemoryEventLog": "engine.events.memory_log",
    "RedisEventLog": "engine.events.redis_log",
    "RedisSettings": "engine.events.redis_log",
    "StreamNames": "engine.events",
    "connect": "engine.events.redis_log",
    "open_log": "engine.events.redis_log",
    # domain, data path, scheduling
    "Resource": "engine.domain",
    "StoppingCriteria": "engine.domain",
    "SamplingParams": "engine.domain",
    "DatasetEntry": "engine.domain",
    "EvalDatasetConfig": "engine.domain",
    "EvaluatorProfile": "engine.domain",
    "Task": "engine.domain",
    "Batch": "engine.domain",
    "MultiDataSource": "engine.data_source",
    "fifo_batching": "engine.batching",
    # episodes and samples
    "BaseAgent": "engine.agents.base",
    "AgentResult": "engine.agents.base",
    "EpisodeContext": "engine.agents.base",
    "EvaluatorBinding": "engine.agents.binding",
    "Episode": "engine.agents.base",
    "EpisodeAgent": "engine.agents.base",
    "ToolAgent": "engine.agents.tool_agent",
    "ToolAgentConfig": "engine.agents.tool_agent",
    "Sample": "engine.sample",
    # trainer client
    "RolloutClient": "engine.client",
    "SyncRolloutClient": "engine.client",
    "collate": "engine.client",
    # model backends
    "ModelBackend": "engine.backends.base",
    "GenerationResult": "engine.backends.base",
    "BackendPool": "engine.backends.pool",
    "SGLangBackend": "engine.backends.sglang",
    "SGLangConfig": "engine.backends.sglang",
    "OpenAIBackend": "engine.backends.openai",
    "OpenAIConfig": "engine.backends.openai",
    "TeacherBackend": "engine.backends.teacher",
    "TeacherConfig": "engine.backends.teacher",
    # sandboxes
    "Sandbox": "engine.sandbox.base",
    "SandboxProvider": "engine.sandbox.base",
    "SandboxLimits": "engine.sandbox.base",
    "LocalSandboxProvider": "engine.sandbox.local",
    "LocalSandboxConfig": "engine.sandbox.local",
    "DockerSandboxProvider": "engine.sandbox.docker",
    "DockerSandboxConfig": "engine.sandbox.docker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
