"""`rollout demo` end to end: real processes, real Redis, tinylm, local sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    workdir = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.ops.cli", "demo", "--workdir", str(workdir),
         "--train-steps", "10", "--prompts", "18", "--samples-per-prompt", "2"],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return workdir, proc.stdout


def _rollout_dirs(workdir: Path) -> list[Path]:
    return sorted((workdir / "out").iterdir())


def test_demo_runs_train_and_eval_and_says_where_things_are(demo_run: tuple[Path, str]) -> None:
    workdir, out = demo_run
    assert out.count(": READY in") == 2
    assert "replay with: rollout replay" in out
    assert "every process stopped" in out
    dirs = _rollout_dirs(workdir)
    assert len(dirs) == 2
    kinds = {json.loads((d / "summary.json").read_text())["kind"] for d in dirs}
    assert kinds == {"train", "eval"}
    train = next(d for d in dirs
                 if json.loads((d / "summary.json").read_text())["kind"] == "train")
    summary = json.loads((train / "summary.json").read_text())
    assert summary["n_samples"] == 36
    assert set(summary["datasets"]) == {"math_train", "shell_train"}  # mixed: FIFO spans both
    assert (workdir / "archives" / f"{train.name}.rollout").is_file()


def test_demo_redis_is_authenticated_and_its_password_stays_off_the_terminal(
    demo_run: tuple[Path, str],
) -> None:
    _, out = demo_run
    line = next(line for line in out.splitlines() if line.startswith("redis "))
    assert "redis-server at redis://engine:***@127.0.0.1:" in line, line
    assert "WARNING" not in line


def test_demo_leaves_no_process_behind(demo_run: tuple[Path, str]) -> None:
    workdir, _ = demo_run
    assert _processes_mentioning(str(workdir)) == []


def test_every_trajectory_is_token_consistent(demo_run: tuple[Path, str]) -> None:
    workdir, _ = demo_run
    n = 0
    for d in _rollout_dirs(workdir):
        for line in (d / "samples.jsonl").read_text().splitlines():
            s = json.loads(line)
            if s["remove_sample"]:
                continue
            n += 1
            r = s["response_length"]
            assert len(s["loss_mask"]) == r == len(s["rollout_log_probs"])
            assert len(s["tokens"]) > r  # prompt + response
            assert s["loss_mask"][0] == 1  # the response starts with a generation
            for mask, lp in zip(s["loss_mask"], s["rollout_log_probs"], strict=True):
                if mask == 0:
                    assert lp == 0.0  # observations carry no logprob
                else:
                    assert lp <= 0.0
    assert n > 0


def test_replay_from_archive_is_byte_identical(demo_run: tuple[Path, str],
                                               tmp_path: Path) -> None:
    workdir, _ = demo_run
    for d in _rollout_dirs(workdir):
        archive = workdir / "archives" / f"{d.name}.rollout"
        out = tmp_path / d.name
        proc = subprocess.run(
            [sys.executable, "-m", "engine.ops.cli", "replay", d.name, "--from", str(archive),
             "--out", str(out)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        live = {p.name: p.read_bytes() for p in d.iterdir()}
        replayed = {p.name: p.read_bytes() for p in out.iterdir()}
        assert replayed == live
