"""`rollout demo` end to end: real processes, real Redis, tinylm, local sandbox."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow


def _children(pid: int, mentioning: str) -> list[int]:
    """The live child processes of ``pid`` whose command line contains ``mentioning``."""
    found = []
    for child in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, NotADirectoryError):
            continue
        fields = stat.rpartition(")")[2].split()  # after "(comm)": state, ppid, ...
        if fields[0] != "Z" and int(fields[1]) == pid and mentioning.encode() in cmdline:
            found.append(int(child))
    return found


def kill_and_wait_restart(demo_pid: int, lines: list[str]) -> str:
    """SIGKILL the demo's policy server, a child of its ``rollout serve``; wait for serve
    to bring it back on the same URL at the active version (0: nothing was published).
    Returns ``"[restarted] <old pid> <new pid> <weight_version>"``."""
    url = next(line for line in lines if line.startswith("policy ")).split()[4]
    [serve] = _children(demo_pid, "workers serve")
    [server] = _children(serve, "tinylm serve")
    os.kill(server, signal.SIGKILL)
    for _ in range(600):
        again = [pid for pid in _children(serve, "tinylm serve") if pid != server]
        if again:
            try:
                info = httpx.get(url + "/get_model_info", timeout=5).json()
            except httpx.HTTPError:
                pass
            else:
                return f"[restarted] {server} {again[0]} {info['weight_version']}\n"
        time.sleep(0.2)
    raise AssertionError(f"rollout serve did not restart the server at {url}")


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
    """One ``rollout demo --keep``: while the stack is up, the commands it prints are run
    (their output is appended to the demo's); then SIGTERM stops it."""
    workdir = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "demo", "--workdir", str(workdir),
         "--train-steps", "10", "--prompts", "18", "--samples-per-prompt", "2", "--keep"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stop it with"):
                break
        commands = [line.split(maxsplit=1)[1].split() for line in lines
                    if line.startswith(("  rollout status", "  rollout pool"))]
        assert commands, "".join(lines)
        # The credentials come through the printed export line (a 0600 file), not the URL.
        exports = [line.split()[1:] for line in lines if line.startswith("  export ")]
        assert len(exports) == 1, "".join(lines)
        inspect_env = {**env, **dict(item.split("=", 1) for item in exports[0])}
        for argv in commands:
            inspected = subprocess.run(
                [sys.executable, "-m", "workers", *argv], capture_output=True,
                text=True, timeout=60, env=inspect_env, check=False,
            )
            assert inspected.returncode == 0, inspected.stdout + inspected.stderr
            lines.append(f"[{argv[0]}]\n{inspected.stdout}")
        lines.append(kill_and_wait_restart(proc.pid, lines))
        proc.send_signal(signal.SIGTERM)
        lines.extend(proc.stdout)
        assert proc.wait(timeout=120) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return workdir, "".join(lines)


def _rollout_dirs(workdir: Path) -> list[Path]:
    return sorted((workdir / "out").iterdir())


def test_demo_runs_train_and_eval_and_says_where_things_are(demo_run: tuple[Path, str]) -> None:
    workdir, out = demo_run
    assert out.count(": READY in") == 2
    assert "replay with: rollout replay" in out
    assert "every process stopped" in out
    assert out.count("samples re-scored on the server") == 2  # the verification boundary
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


def test_kept_stack_can_be_inspected_with_the_printed_commands(
    demo_run: tuple[Path, str]
) -> None:
    _, out = demo_run
    assert "the stack is still up (--keep)" in out
    assert out.count("[status]") == 2 and out.count(": READY: ") == 2  # status lines
    assert "[pool]" in out and "0 batches holding 0 tokens" in out
    assert "stopping the kept stack" in out


def test_the_policy_server_is_a_rollout_serve_child_restarted_after_a_sigkill(
    demo_run: tuple[Path, str],
) -> None:
    workdir, out = demo_run
    line = next(line for line in out.splitlines() if line.startswith("policy "))
    assert "tinylm server at http://127.0.0.1:" in line and "rollout serve" in line, line
    [restarted] = [line.split()[1:] for line in out.splitlines() if line.startswith("[restarted]")]
    old, new, version = restarted
    assert old != new and version == "0"  # back at the active version, on the same URL
    assert (workdir / "logs" / "serve.log").is_file()
    assert (workdir / "logs" / "policy-0.log").is_file()  # the server's, beside the others


def test_demo_says_how_long_the_model_build_takes(demo_run: tuple[Path, str]) -> None:
    _, out = demo_run
    assert "10 training steps, about" in out
    assert "model     10/10" in out  # the build's progress, without a terminal: plain lines
    assert "built in" in out


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
            [sys.executable, "-m", "workers", "replay", d.name, "--from", str(archive),
             "--out", str(out)],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        live = {p.name: p.read_bytes() for p in d.iterdir()}
        replayed = {p.name: p.read_bytes() for p in out.iterdir()}
        assert replayed == live
