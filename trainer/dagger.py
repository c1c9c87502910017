"""The evaluator config of ``--algorithm mixed``: the bundled tasks with DAgger agents.

The bundled config (``engine/tasks/evaluators.py``) runs ``math`` and ``shell`` with plain
tool agents and only its ``dagger`` task (math prompts, task type ``dagger``) with a
``DAggerAgent``. For the mixed CE/K3 lane on the trainer's datasets (``math_train``,
``shell_train``, ...), every episode must roll in the teacher: this file is an evaluator
config (workers load it with ``--evaluator-config``; ``DAGGER_CONFIG`` is its path) with the
bundled profiles whose ``build_agents`` makes all three agents DAgger agents. Each lets the
teacher act on a turn with the request's ``dagger_beta`` (before ``t_max``) and records the
is-teacher mask and the cut points. The teacher is the worker's own ``TeacherBackend`` port
(``--teacher-url`` / ``--teacher-tokenizer``, handed over as ``args.teacher``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.agents.base import BaseAgent
from engine.agents.dagger import DAggerAgent
from engine.backends.sglang import load_tokenizer
from engine.backends.teacher import TeacherBackend
from engine.errors import ConfigError
from engine.tasks.evaluators import evaluator_profiles, math_agent_config, shell_agent_config
from engine.tasks.math import MathVerifier
from engine.tasks.shell import ShellVerifier

__all__ = ["DAGGER_CONFIG", "build_agents", "evaluator_profiles"]

DAGGER_CONFIG = Path(__file__).resolve()


def _arg(args: object, name: str) -> Any:
    return args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)


def build_agents(args: object) -> dict[str, BaseAgent]:
    """The bundled config's ``math``, ``shell`` and ``dagger`` agents, all as DAgger agents
    on the worker's teacher (``args.teacher``)."""
    model_dir = _arg(args, "tokenizer_path") or _arg(args, "model_dir")
    if not model_dir:
        raise ConfigError("the DAgger agents need the policy's tokenizer: pass --model-dir")
    teacher = _arg(args, "teacher")
    if not isinstance(teacher, TeacherBackend):
        raise ConfigError(
            "the DAgger agents need the worker's teacher: pass --teacher-url and "
            f"--teacher-tokenizer (args.teacher is {type(teacher).__name__})"
        )
    path = Path(str(model_dir))
    url = _arg(args, "sglang_url") or None
    tokenizer = load_tokenizer(path)

    def agent(config: Any, verifier: Any) -> DAggerAgent:
        return DAggerAgent(config, verifier=verifier, teacher=teacher, tokenizer=tokenizer)

    return {
        "math": agent(math_agent_config(path, url), MathVerifier()),
        "shell": agent(shell_agent_config(path, url), ShellVerifier()),
        "dagger": agent(math_agent_config(path, url), MathVerifier()),
    }
