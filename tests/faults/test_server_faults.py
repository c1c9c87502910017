"""The model-server fault suite: a few seeds of the scenario of
``tests/faults/server_harness.py`` (``bench/server_faults.py`` prints the figures). Each seed
SIGKILLs a server and restarts it, SIGSTOPs one past ``stall_s``, kills both and restarts
them, and restarts one from older weights after a newer version is active, while two workers
bound to both servers run rollouts; a failure lists every violated check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.faults.server_harness import FAULTS, Workload, run_scenario

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]

SEEDS = (1, 2)


@pytest.mark.parametrize("seed", SEEDS)
async def test_rollouts_survive_every_server_fault(seed: int, tinylm_dir: Path,
                                                   tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    report = await run_scenario(seed, tinylm_dir, Workload(), tmp_path)
    assert report.violations == [], (report.faults, report.violations)
    assert report.rollouts_completed == report.rollouts_requested
    assert report.samples_aborted == report.infra_dummies == 0
    assert report.wrong_version_turns == report.repeated_turns == 0
    assert report.turns == report.samples * 3
    # Every fault kind was injected (the seeded order differs, the set does not).
    assert [f.split()[0] for f in report.faults if "skipped" not in f] != []
    assert {f.split()[0] for f in report.faults} == set(FAULTS)
