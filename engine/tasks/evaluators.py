"""Evaluator config of the bundled tasks ``math``, ``shell`` and ``dagger``:
``evaluator_profiles(args)`` and ``build_agents(args)``.

Pass this file as ``--evaluator-config`` (``ROLLOUT_EVALUATOR_CONFIG``); its path is
``engine.tasks.EVALUATOR_CONFIG``. The scheduler reads only the profiles (which need nothing
from ``args``); evaluator workers also build the agents. Each task type gets its own
``ToolAgent`` (one agent per profile, each with its verifier, rather than one agent
dispatching on the task type: the profile already routes by task type, and each agent then
offers only the tool its task needs):

- ``math``: tool ``python``, ``MathVerifier`` (final answer against the label);
- ``shell``: tool ``shell``, ``ShellVerifier`` (the label's check command, run in the episode's
  sandbox after the agent is done);
- ``dagger``: the ``math`` task under a DAgger rollin (``DAggerAgent``: per turn, with
  probability ``dagger_beta`` and only before turn ``t_max``, the teacher's action is executed
  instead of the student's). Its datasets are in ``engine.tasks.DAGGER_ROLLOUT_CONFIG``
  (task type ``dagger``, the math prompts); request it with ``algorithm="dagger_k3"`` (or
  ``mixed_ce_k3``, ``dagger_ce``) and the knobs ``dagger_beta`` / ``t_max``.

What ``build_agents`` reads from ``args`` (attributes, or keys when ``args`` is a mapping):

- ``tokenizer_path``, else ``model_dir`` (required): the policy's Hugging Face folder, e.g. one
  written by ``rollout tinylm init DIR``; the tokenizer and its chat template load from it
  once, shared by both agents;
- ``sglang_url`` (optional): the SGLang server; without it each episode uses the worker's
  ``--sglang-url`` (the default endpoint of ``EpisodeContext.backends``);
- ``teacher`` (optional): the worker's ``TeacherBackend`` (``--teacher-url`` /
  ``ROLLOUT_TEACHER_URL``), which the ``dagger`` agent uses and never closes. Without it the
  ``dagger`` agent runs student-only turns, and a turn the teacher should act on fails its
  sample with an error naming the missing setting.

The sandbox provider is the worker's (``EpisodeContext.sandboxes``); per-sample sandbox
limits are set here. Resources: no GPU (the model server is its own process), a quarter CPU and
half a GiB per sample, batches of 8, at most 16 (math) / 8 (shell) samples at once per batch.
Default stopping matches the bundled ``rollout.yaml``.
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
    """The ``math`` agent: a python tool and the math system prompt."""
    return ToolAgentConfig(
        tools=(PythonTool(),),
        system_prompt=MATH_SYSTEM_PROMPT,
        tokenizer_path=tokenizer_path,
        sglang_url=sglang_url,
        sandbox_limits=_SANDBOX_LIMITS,
        tool_timeout_s=10.0,
        max_observation_chars=_OBSERVATION_CHARS,
    )


def shell_agent_config(
    tokenizer_path: Path | None = None, sglang_url: str | None = None
) -> ToolAgentConfig:
    """The ``shell`` agent: a shell tool and the shell system prompt."""
    return ToolAgentConfig(
        tools=(ShellTool(),),
        system_prompt=SHELL_SYSTEM_PROMPT,
        tokenizer_path=tokenizer_path,
        sglang_url=sglang_url,
        sandbox_limits=_SANDBOX_LIMITS,
        tool_timeout_s=10.0,
        max_observation_chars=_OBSERVATION_CHARS,
    )


def _arg(args: object, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name)
    return getattr(args, name, None)


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    """The ``math``, ``shell`` and ``dagger`` profiles (``args`` is not read)."""
    per_sample = Resource(cpu=0.25, memory_gb=0.5)
    return [
        EvaluatorProfile(
            evaluator_id="math",
            resource=Resource(cpu=4.0, memory_gb=8.0, concurrency=16),
            run_resource=per_sample,
            eval_resource=Resource(cpu=0.25, memory_gb=0.25),
            batch_size=8,
            default_stopping=DEFAULT_STOPPING,
        ),
        EvaluatorProfile(
            evaluator_id="shell",
            resource=Resource(cpu=2.0, memory_gb=4.0, concurrency=8),
            run_resource=per_sample,
            eval_resource=per_sample,
            batch_size=8,
            default_stopping=DEFAULT_STOPPING,
        ),
        EvaluatorProfile(
            evaluator_id="dagger",
            resource=Resource(cpu=4.0, memory_gb=8.0, concurrency=16),
            run_resource=per_sample,
            eval_resource=Resource(cpu=0.25, memory_gb=0.25),
            batch_size=8,
            default_stopping=DEFAULT_STOPPING,
        ),
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    """The ``math`` and ``shell`` agents (see the module docstring for what ``args`` holds)."""
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
