"""Evaluator config of the bundled tasks ``math``, ``shell`` and ``dagger``
(``--evaluator-config``; its path is ``engine.tasks.EVALUATOR_CONFIG``).

One ``ToolAgent`` per task type, each offering only the tool its task needs (the profile
already routes by task type): ``math`` a ``python`` tool and ``MathVerifier``, ``shell`` a
``shell`` tool and ``ShellVerifier``, ``dagger`` the math task under a DAgger rollin
(``DAggerAgent``; request it with ``algorithm="dagger_k3"``, ``mixed_ce_k3`` or ``dagger_ce``
and the knobs ``dagger_beta`` / ``t_max``).

``build_agents`` reads from ``args`` (attributes, or keys of a mapping): ``tokenizer_path``,
else ``model_dir`` (required: the policy's Hugging Face folder, its tokenizer shared by the
agents); ``sglang_url`` (optional; default the worker's ``--sglang-url``); ``teacher``
(optional: the worker's ``TeacherBackend``, never closed here; without it a turn the teacher
should act on fails its sample naming the missing setting).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.agents.base import BaseAgent
from engine.agents.dagger import DAggerAgent
from engine.agents.tool_agent import ToolAgent, ToolAgentConfig
from engine.agents.tools import PythonTool, ShellTool
from engine.backends.sglang import load_tokenizer
from engine.backends.teacher import TeacherBackend
from engine.domain import EvaluatorProfile, Resource, StoppingCriteria
from engine.errors import ConfigError
from engine.sandbox import SandboxLimits
from engine.tasks.math import MathVerifier
from engine.tasks.prompts import MATH_SYSTEM_PROMPT, SHELL_SYSTEM_PROMPT
from engine.tasks.shell import ShellVerifier

__all__ = [
    "MATH_SYSTEM_PROMPT",
    "SHELL_SYSTEM_PROMPT",
    "build_agents",
    "evaluator_profiles",
    "math_agent_config",
    "shell_agent_config",
]

DEFAULT_STOPPING = StoppingCriteria(
    max_turns=4, max_context_len=1024, max_new_tokens=96, timeout_s=120.0
)

_SANDBOX_LIMITS = SandboxLimits(
    cpu_time_s=10.0,
    memory_mb=512,
    max_procs=64,
    wall_timeout_s=30.0,
    max_output_bytes=16 * 1024,
    disk_mb=64,
)

# Tool output beyond this is clipped (head and tail kept): with a 1024-token context, an
# unfamiliar traceback (about a token per character for tinylm) must not fill the episode.
_OBSERVATION_CHARS = 600


def math_agent_config(
    tokenizer_path: Path | None = None, sglang_url: str | None = None
) -> ToolAgentConfig:
    return _agent_config(PythonTool(), MATH_SYSTEM_PROMPT, tokenizer_path, sglang_url)


def shell_agent_config(
    tokenizer_path: Path | None = None, sglang_url: str | None = None
) -> ToolAgentConfig:
    return _agent_config(ShellTool(), SHELL_SYSTEM_PROMPT, tokenizer_path, sglang_url)


def _agent_config(
    tool: PythonTool | ShellTool, prompt: str, tokenizer_path: Path | None, url: str | None
) -> ToolAgentConfig:
    return ToolAgentConfig(
        tools=(tool,),
        system_prompt=prompt,
        tokenizer_path=tokenizer_path,
        sglang_url=url,
        sandbox_limits=_SANDBOX_LIMITS,
        tool_timeout_s=10.0,
        max_observation_chars=_OBSERVATION_CHARS,
    )


def _arg(args: object, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    """The ``math``, ``shell`` and ``dagger`` profiles; ``args`` is not read."""
    per_sample = Resource(cpu=0.25, memory_gb=0.5)
    math_budget = Resource(cpu=4.0, memory_gb=8.0, concurrency=16)
    math_check = Resource(cpu=0.25, memory_gb=0.25)
    return [
        EvaluatorProfile(
            evaluator_id=evaluator_id,
            resource=budget,
            run_resource=per_sample,
            eval_resource=check,
            batch_size=8,
            default_stopping=DEFAULT_STOPPING,
        )
        for evaluator_id, budget, check in (
            ("math", math_budget, math_check),
            ("shell", Resource(cpu=2.0, memory_gb=4.0, concurrency=8), per_sample),
            ("dagger", math_budget, math_check),
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    raw_path = _arg(args, "tokenizer_path") or _arg(args, "model_dir")
    if not raw_path:
        raise ConfigError(
            "the bundled task agents need the policy's tokenizer: set args.tokenizer_path "
            "(or args.model_dir) to a Hugging Face folder, e.g. one made by "
            "`rollout tinylm init DIR`"
        )
    tokenizer_path = Path(str(raw_path))
    url = _arg(args, "sglang_url") or None
    if url is not None and not isinstance(url, str):
        raise ConfigError(f"args.sglang_url must be a URL string, got {url!r}")
    teacher = _arg(args, "teacher")
    if teacher is not None and not isinstance(teacher, TeacherBackend):
        raise ConfigError(f"args.teacher must be a TeacherBackend, got {type(teacher).__name__}")
    tokenizer = load_tokenizer(tokenizer_path)
    return {
        "math": ToolAgent(
            math_agent_config(tokenizer_path, url), verifier=MathVerifier(), tokenizer=tokenizer
        ),
        "shell": ToolAgent(
            shell_agent_config(tokenizer_path, url), verifier=ShellVerifier(), tokenizer=tokenizer
        ),
        "dagger": DAggerAgent(
            math_agent_config(tokenizer_path, url),
            verifier=MathVerifier(),
            teacher=teacher,
            tokenizer=tokenizer,
        ),
    }
