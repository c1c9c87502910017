"""The model-server fault suite: a few seeds of the scenario of
``tests/faults/server_harness.py`` (``bench/server_faults.py`` prints the figures). Each seed
SIGKILLs a server and restarts it, SIGSTOPs one past ``stall_s``, kills both and restarts
them, and restarts one from older weights after a newer version is active, while two workers
bound to both servers run rollouts; a failure lists every violated check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.events import Envelope, PolicyVersionActivated
from tests.faults.server_harness import FAULTS, Report, Workload, _check_turns, run_scenario

SEEDS = (1, 2)


@pytest.mark.slow
@pytest.mark.redis_server
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
    # Every fault kind was injected (the seeded order differs, the set does not), and the
    # stall was measured on a server that had a generation running.
    assert sorted(f.split()[0] for f in report.faults) == sorted(FAULTS)
    assert not any("skipped" in f for f in report.faults), report.faults
    assert report.stall_detect_s is not None and report.stall_detect_s >= 0
    assert report.restart_to_serving_s is not None and report.stale_to_serving_s is not None


def _activated(at_s: float, version: int) -> Envelope:
    return Envelope(id=f"{int(at_s * 1000)}-0", stream="rl:control",
                    event=PolicyVersionActivated(version=version, servers=["http://a"]))


def _turn(sid: str, turn: int, version: int, t0: float, t1: float,
          attempt: int = 1) -> dict[str, object]:
    return {"sid": sid, "attempt": attempt, "turn": turn, "url": "http://a",
            "version": version, "t0": t0, "t1": t1}


def test_the_turn_checks_name_a_stale_turn_a_turn_run_twice_and_a_rerun_attempt() -> None:
    control = [_activated(100.0, 1), _activated(200.0, 2)]
    fine = [_turn("r:s0", 0, 1, 150.0, 151.0), _turn("r:s0", 1, 2, 199.5, 200.5),
            _turn("r:s0", 2, 2, 201.0, 202.0)]
    report = Report(seed=0)
    _check_turns(fine, control, report)
    assert report.violations == [] and report.turns == 3
    bad = [_turn("r:s1", 0, 1, 250.0, 251.0),  # version 1 served while 2 is active
           _turn("r:s2", 0, 2, 210.0, 211.0), _turn("r:s2", 0, 2, 212.0, 213.0),
           _turn("r:s3", 0, 2, 220.0, 221.0, attempt=2)]
    report = Report(seed=0)
    _check_turns(bad, control, report)
    assert report.wrong_version_turns == 1 and report.repeated_turns == 1
    assert len(report.violations) == 3, report.violations
    assert "served by http://a at version 1, active: 2" in report.violations[-1]
    assert any("r:s3 was run again" in v for v in report.violations)
