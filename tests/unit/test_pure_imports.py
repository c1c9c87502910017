"""What the import-linter contracts cannot see: a package's ``__init__`` runs whenever one of
its modules is imported. Importing the pure layers in a fresh interpreter must load no Redis
client at all (``engine.events`` is importable without the adapter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "module",
    [
        "engine.projections.placement",
        "engine.projections.rollout",
        "engine.domain",
        "engine.events",
        "engine.events.memory_log",
        "engine.runtime.loop",
        "engine.actors.scheduler",
        "engine.actors.evaluator_worker",
        "engine.settings",
    ],
)
def test_a_pure_layer_imports_no_redis(module: str) -> None:
    probe = (
        f"import {module}, sys; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'fakeredis')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "[]", f"importing {module} loaded {done.stdout.strip()}"


def test_the_adapter_does_load_redis() -> None:
    """The probe can fail: the Redis adapter's module does load the client."""
    probe = "import engine.events.redis_log, sys; print('redis' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120,
        check=True,
    )
    assert done.stdout.strip() == "True"
