"""Model backends: the ``ModelBackend`` port and its SGLang, OpenAI-chat and teacher adapters.

See ``base.py`` for the contract every backend keeps, ``sglang.py`` for the token-level student
path, ``openai.py`` for chat APIs, ``teacher.py`` for force-decoding on a frozen teacher,
``fidelity.py`` for checking that sampled logprobs match a re-score and ``pool.py`` for the
backends a worker holds (one per endpoint) and hands to its episodes.
"""

from engine.backends._http import HTTPSettings
from engine.backends.base import FinishReason, GenerationResult, ModelBackend, ToolCall, Usage
from engine.backends.fidelity import FidelityReport, check_generation, check_token_fidelity
from engine.backends.openai import OpenAIBackend, OpenAIConfig
from engine.backends.pool import BackendPool
from engine.backends.sglang import ForceDecodeScore, SGLangBackend, SGLangConfig
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.backends.toolcalls import parse_tool_calls, render_tool_call

__all__ = [
    "BackendPool",
    "FidelityReport",
    "FinishReason",
    "ForceDecodeScore",
    "GenerationResult",
    "HTTPSettings",
    "ModelBackend",
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
