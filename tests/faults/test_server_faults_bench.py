"""``bench/server_faults.py`` runs end to end at a small size: its file is the worker's
evaluator config, its four phases complete, and the last line has the keys the docs name."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from bench.server_faults import EVALUATOR, PolicyTurns, main_async
from engine.config.evaluators import load_evaluators
from tests.redis_server import redis_required

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "server_faults.py"
KEYS = {
    "one_dead_throughput_share",
    "samples_lost",
    "infra_dummies_in_training",
    "stall_s",
    "stall_detect_s",
    "restart_to_serving_s",
}


def test_the_bench_file_is_an_evaluator_config() -> None:
    specs = load_evaluators(BENCH, argparse.Namespace())
    assert list(specs) == [EVALUATOR]
    assert type(specs[EVALUATOR].agent).__name__ == PolicyTurns.__name__


async def test_the_bench_runs_its_phases_and_loses_nothing() -> None:
    if shutil.which("redis-server") is None and not redis_required():
        pytest.skip("redis-server is not installed")
    args = argparse.Namespace(samples_per_phase=8, stall_s=1.5, seed=0, server_slots=4)
    out = await main_async(args)
    assert KEYS <= set(out)
    assert list(out["phases"]) == ["warmup", "both_up", "one_dead", "restart", "stall"]
    assert out["samples_lost"] == 0 and out["infra_dummies_in_training"] == 0
    assert all(p["n_completed"] == 8 for p in out["phases"].values())
    assert out["stall_detect_s"] >= out["stall_s"]  # a stall is given up only after stall_s
    assert out["phases"]["restart"]["up_weight_version"] == 1
