"""The bundled tasks: arithmetic with a ``python`` tool, file tasks with a ``shell`` tool.

``ROLLOUT_CONFIG`` names the bundled datasets (``data/*.jsonl``) of task types ``math`` and
``shell``, ``DAGGER_ROLLOUT_CONFIG`` the math prompts as task type ``dagger``, and
``EVALUATOR_CONFIG`` is the evaluator config file that runs all three. Importing this package
loads nothing heavy.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DAGGER_ROLLOUT_CONFIG", "DATA_DIR", "EVALUATOR_CONFIG", "ROLLOUT_CONFIG"]

_HERE = Path(__file__).resolve().parent

DATA_DIR = _HERE / "data"
ROLLOUT_CONFIG = _HERE / "rollout.yaml"
DAGGER_ROLLOUT_CONFIG = _HERE / "dagger.yaml"
EVALUATOR_CONFIG = _HERE / "evaluators.py"
