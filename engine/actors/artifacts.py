"""Write a rollout's artifacts to a directory: the one function the live finalizer and
``rollout replay`` both call, so a replay writes the live run's files by construction.

The bytes come from the pure :func:`engine.projections.summary.render_artifacts`; each file
is written atomically, so a reader never sees half of one.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.projections.readback import Rollout
from engine.projections.summary import render_artifacts

__all__ = ["write_artifacts", "write_files"]


def write_files(files: dict[str, bytes], out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write ``name -> bytes`` into ``out_dir`` (created if missing), each atomically."""
    directory = Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, data in files.items():
        path = directory / name
        tmp = directory / f".{name}.tmp-{os.getpid()}"
        tmp.write_bytes(data)
        os.replace(tmp, path)
        written[name] = path
    return written


def write_artifacts(rollout: Rollout, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Render the rollout's artifacts and write them into ``out_dir``; returns their paths."""
    return write_files(render_artifacts(rollout), out_dir)
