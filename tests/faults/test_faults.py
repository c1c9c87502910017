"""The fault-injection suite: a few seeds of the scenario of ``tests/faults/harness.py``
(``bench/faults.py`` runs many). Each seed kills every kind of process, restarts
redis-server twice and injects garbage while rollouts run, then checks what the agent
observed and what the log holds; a failure lists every violated check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.harness import Workload, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]

SEEDS = (1, 2)


@pytest.mark.parametrize("seed", SEEDS)
async def test_rollouts_survive_every_fault(seed: int, tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    report = await run_scenario(seed, Workload(), tmp_path)
    assert report.violations == [], (report.faults, report.violations)
    assert report.rollouts_completed == report.rollouts_requested
    assert report.peak_overcommit <= 0
    assert report.garbage >= 3 and report.dead_letter_copies == 0
    # Every fault kind was injected (the seeded order differs, the set does not).
    kinds = {f.split()[0] for f in report.faults}
    assert kinds == {"kill-worker", "kill-scheduler", "kill-finalizer", "term-worker",
                     "redis-restart", "garbage"}
    assert sum(f.startswith("redis-restart") for f in report.faults) == 2
