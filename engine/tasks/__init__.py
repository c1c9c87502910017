"""The bundled tasks: arithmetic with a ``python`` tool and file tasks with a ``shell`` tool.

- ``ROLLOUT_CONFIG``: the rollout YAML naming the bundled datasets (``data/*.jsonl``; rows
  ``{"id", "prompt", "label"}``) and their task types ``math`` and ``shell``;
- ``DAGGER_ROLLOUT_CONFIG``: the math prompts as task type ``dagger`` (a DAgger rollin with
  a teacher; see ``engine.tasks.evaluators``);
- ``EVALUATOR_CONFIG``: the evaluator config file (``evaluator_profiles(args)``,
  ``build_agents(args)``) that runs them
  with the native ``ToolAgent`` (``engine.tasks.evaluators``);
- ``engine.tasks.math`` / ``engine.tasks.shell``: their verifiers.

Importing this package loads nothing heavy; the submodules are imported where used.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DAGGER_ROLLOUT_CONFIG", "DATA_DIR", "EVALUATOR_CONFIG", "ROLLOUT_CONFIG"]

_HERE = Path(__file__).resolve().parent

DATA_DIR = _HERE / "data"
ROLLOUT_CONFIG = _HERE / "rollout.yaml"
DAGGER_ROLLOUT_CONFIG = _HERE / "dagger.yaml"
EVALUATOR_CONFIG = _HERE / "evaluators.py"
