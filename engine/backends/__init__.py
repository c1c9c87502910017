"""Model backends: the ``ModelBackend`` port and its SGLang, OpenAI-chat and teacher adapters.

See ``base.py`` for the contract every backend keeps and its ``Capabilities``, ``sglang.py``
for the token-level student path, ``openai.py`` for chat APIs, ``teacher.py`` for
force-decoding on a frozen teacher, ``fidelity.py`` for checking that sampled logprobs match a
re-score, ``pool.py`` for the backends a worker holds (one per endpoint) and hands to its
episodes, and ``hooks.py`` for what runs around each of their calls.
"""

from engine.backends._http import HTTPSettings
from engine.backends.base import (
    Capabilities,
    FinishReason,
    ForceDecodeScore,
    GenerationResult,
    ModelBackend,
    ToolCall,
    Usage,
)
from engine.backends.fidelity import FidelityReport, check_generation, check_token_fidelity
from engine.backends.hooks import CallHook, CallKind, ModelCall
from engine.backends.openai import OpenAIBackend, OpenAIConfig
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.backends.toolcalls import parse_tool_calls, render_tool_call

__all__ = [
    "BackendPool",
    "CallHook",
    "CallKind",
    "Capabilities",
    "FidelityReport",
    "FinishReason",
    "ForceDecodeScore",
    "GenerationResult",
    "HTTPSettings",
    "ModelBackend",
    "ModelCall",
    "OpenAIBackend",
    "OpenAIConfig",
    "SGLangBackend",
    "SGLangConfig",
    "TeacherBackend",
    "TeacherConfig",
    "ToolCall",
    "Usage",
    "check_generation",
    "check_token_fidelity",
    "parse_tool_calls",
    "render_tool_call",
]
