"""The ``rollout`` command: the operator tools of ``engine.ops.cli`` with the engine's
process entry points, which only this top layer may import (the tools sit below it).

``python -m workers ...`` runs the same command; the demo starts its processes through it
(:data:`ROLLOUT`), so they run exactly what ``rollout worker`` and the others run.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from engine.ops import cli

__all__ = ["PROCESSES", "ROLLOUT", "main"]

ROLLOUT = ("-m", "workers")
"""The Python arguments that run the ``rollout`` command in a new process."""


def _worker(argv: list[str]) -> int:
    from workers.evaluator import main as run

    return run(argv)


def _finalizer(argv: list[str]) -> int:
    from workers.finalizer import main as run

    return run(argv)


def _capture(argv: list[str]) -> int:
    from workers.capture import main as run

    return run(argv)


def _scheduler(argv: list[str]) -> int:
    from workers.scheduler import main as run

    return run(argv)


def _sync(argv: list[str]) -> int:
    from workers.sync import main as run

    return run(argv)


def _serve(argv: list[str]) -> int:
    from workers.serve import main as run

    return run(argv)


PROCESSES: dict[str, cli.Entry] = {
    "worker": _worker,
    "finalizer": _finalizer,
    "capture": _capture,
    "scheduler": _scheduler,
    "sync": _sync,
    "serve": _serve,
}
"""``rollout <command>`` -> the process's entry point (each owns its flags); the commands
and what they run are listed in ``engine.ops.cli.PROCESS_COMMANDS``."""


def main(argv: Sequence[str] | None = None) -> int:
    return cli.main(sys.argv[1:] if argv is None else argv, processes=PROCESSES, rollout=ROLLOUT)
