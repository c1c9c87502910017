"""The public API listed in engine.__all__ resolves, and importing engine stays light."""

from __future__ import annotations

import subprocess
import sys

import engine


def test_every_public_name_resolves() -> None:
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


def test_import_engine_does_not_pull_torch_or_transformers() -> None:
    code = "import sys, engine; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]
