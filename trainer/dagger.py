"""The evaluator config of ``--algorithm mixed``: the bundled tasks with DAgger agents.

The bundled config (``engine/tasks/evaluators.py``) builds plain tool agents. For the mixed
CE/K3 lane the episodes must roll in the teacher: ``DAggerAgent`` lets the teacher act on a
turn with the request's ``dagger_beta``, and records the is-teacher mask and the cut points.
An evaluator config is a Python file that the workers load, so ``write_config`` writes a
small one into the run's folder, holding the teacher's URL and tokenizer folder. Its
profiles are the bundled ones, and ``build_agents`` calls :func:`dagger_agents`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.agents.base import BaseAgent
from engine.agents.dagger import DAggerAgent
from engine.backends.sglang import load_tokenizer
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.errors import ConfigError
from engine.tasks.evaluators import math_agent_config, shell_agent_config
from engine.tasks.math import MathVerifier
from engine.tasks.shell import ShellVerifier

__all__ = ["dagger_agents", "write_config"]


def _arg(args: object, name: str) -> Any:
    return args.get(name) if isinstance(args, Mapping) else getattr(args, name, None)


def dagger_agents(args: object, *, teacher_url: str, teacher_dir: str) -> dict[str, BaseAgent]:
    """The ``math`` and ``shell`` agents of the bundled config, as DAgger agents."""
    model_dir = _arg(args, "tokenizer_path") or _arg(args, "model_dir")
    if not model_dir:
        raise ConfigError("the DAgger agents need the policy's tokenizer: pass --model-dir")
    path = Path(str(model_dir))
    url = _arg(args, "sglang_url") or None
    tokenizer = load_tokenizer(path)
    teacher = TeacherBackend(config=TeacherConfig(url=teacher_url, tokenizer_path=teacher_dir))
    return {
        "math": DAggerAgent(math_agent_config(path, url), verifier=MathVerifier(),
                            teacher=teacher, tokenizer=tokenizer),
        "shell": DAggerAgent(shell_agent_config(path, url), verifier=ShellVerifier(),
                             teacher=teacher, tokenizer=tokenizer),
    }


_TEMPLATE = '''"""Evaluator config written by the reference trainer for --algorithm mixed."""

from engine.tasks.evaluators import evaluator_profiles
from trainer.dagger import dagger_agents

__all__ = ["build_agents", "evaluator_profiles"]

TEACHER_URL = {url!r}
TEACHER_DIR = {teacher_dir!r}


def build_agents(args):
    return dagger_agents(args, teacher_url=TEACHER_URL, teacher_dir=TEACHER_DIR)
'''


def write_config(path: Path, *, teacher_url: str, teacher_dir: Path) -> Path:
    """Write the evaluator config file for a teacher at ``teacher_url``; returns its path."""
    path.write_text(_TEMPLATE.format(url=teacher_url, teacher_dir=str(teacher_dir)))
    return path
