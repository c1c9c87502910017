"""What the local backend must survive: fork bombs, runaway CPU, huge allocations, escapes,
processes that try to outlive their sandbox, and a worker that crashes mid-episode.

Each test checks the worker's own health afterwards and the process table through ``/proc``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.errors import SandboxError, SandboxEscape
from engine.sandbox import (
    ExecOutcome,
    KillReason,
    LocalSandbox,
    LocalSandboxConfig,
    LocalSandboxProvider,
    _paths,
    _procs,
    classify,
)
from tests.sandbox.conftest import TEST_LIMITS, sandbox_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the local sandbox needs Linux")

SMALL = dataclasses.replace(TEST_LIMITS, max_procs=32, cpu_time_s=5, wall_timeout_s=30)


def sandbox_processes(box: LocalSandbox) -> set[int]:
    """Live processes of the sandbox's commands, by its uid (dedicated mode) or by its marker
    (not the root process holding its network namespace, which lives as long as the sandbox)."""
    own_uid = box.uid if box.path.exists() and _dedicated(box) else None
    marker = _procs.marker(_procs.SANDBOX_MARKER, box.id)
    found = _procs.find_processes(uid=own_uid, env_entry=marker)
    return found - {box.network_holder_pid} if box.network_holder_pid else found


def _dedicated(box: LocalSandbox) -> bool:
    return box.uid is not None and box.uid != 65534


def processes_with_cmdline(fragment: bytes) -> set[int]:
    found = set()
    for pid in _procs.iter_pids():
        info = _procs.proc_info(pid)
        if info is None or info.state in ("Z", "X"):
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if fragment in cmdline:
            found.add(pid)
    return found


def assert_worker_healthy() -> None:
    """The test process can still fork, exec and allocate."""
    done = subprocess.run(["sh", "-c", "echo ok"], capture_output=True, text=True, timeout=30)
    assert done.stdout == "ok\n"
    assert len(bytearray(64 * 2**20)) == 64 * 2**20


@pytest.fixture
async def box(local_provider: LocalSandboxProvider) -> AsyncIterator[LocalSandbox]:
    sandbox = local_provider.create(labels={"rollout.test": "containment"}, limits=SMALL)
    await sandbox.start()
    yield sandbox
    await sandbox.stop()
    assert sandbox_processes(sandbox) == set()
    assert not sandbox.path.exists()


@pytest.fixture
def python() -> str:
    found = sandbox_python()
    if found is None:
        pytest.skip("no Python the sandbox uid can execute")
    return found


async def test_containment_is_reported_and_root_never_runs_commands(
    local_provider: LocalSandboxProvider, box: LocalSandbox
) -> None:
    description = local_provider.containment.describe()
    assert "commands run as" in description
    uid = (await box.exec("id -u")).stdout.strip()
    if os.geteuid() == 0:
        assert local_provider.containment.identity in ("dedicated", "nobody"), description
        assert uid != "0" and int(uid) == box.uid
    else:
        assert int(uid) == os.geteuid()
    status = await box.exec("grep NoNewPrivs /proc/self/status")
    assert status.stdout.split() == ["NoNewPrivs:", "1"]


async def test_python_fork_bomb_is_contained(box: LocalSandbox, python: str) -> None:
    bomb = "import os\nwhile True:\n    os.fork()\n"
    result = await box.exec([python, "-c", bomb], timeout_s=20)
    assert result.killed_by == KillReason.PIDS, result
    assert classify(result) is ExecOutcome.PIDS_LIMIT
    assert_worker_healthy()
    assert (await box.exec("echo usable")).stdout == "usable\n"


async def test_shell_fork_bomb_is_contained(box: LocalSandbox) -> None:
    result = await box.exec("bomb() { bomb | bomb; }; bomb", timeout_s=10)
    assert result.killed_by == KillReason.PIDS, result
    assert_worker_healthy()


async def test_background_fork_bomb_stays_under_the_limit_and_leaves_no_zombies(
    local_provider: LocalSandboxProvider, box: LocalSandbox
) -> None:
    started = await box.exec(":(){ :|:& };:", timeout_s=10)
    assert started.exit_code in (0, 2)  # the function returns; its descendants go on
    bounded = local_provider.containment.identity == "dedicated" or box.cgroup is not None
    peak = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        live = len(sandbox_processes(box))
        peak = max(peak, live)
        if live == 0:
            break
        await asyncio.sleep(0.05)
    if bounded:
        assert peak <= SMALL.max_procs
    assert_worker_healthy()
    # The bomb's dead children were reaped: zombies would count against the limit and break
    # every later fork in this sandbox.
    for _ in range(3):
        result = await box.exec("echo a | cat | cat")
        assert result.stdout == "a\n", result


async def test_cpu_limit_kills_an_infinite_loop(local_provider: LocalSandboxProvider) -> None:
    limits = dataclasses.replace(SMALL, cpu_time_s=1)
    async with local_provider.create(labels={"t": "cpu"}, limits=limits) as cpu_box:
        result = await cpu_box.exec("while :; do :; done", timeout_s=60)
    assert result.killed_by == KillReason.CPU and not result.timed_out, result
    assert result.exit_code == 128 + 24  # SIGXCPU
    assert classify(result) is ExecOutcome.CPU_LIMIT


async def test_wall_clock_kills_an_infinite_loop(box: LocalSandbox) -> None:
    result = await box.exec("while :; do :; done", timeout_s=1)
    assert result.timed_out and result.killed_by == KillReason.TIMEOUT
    assert sandbox_processes(box) == set()


async def test_ten_gigabyte_allocation_is_refused(box: LocalSandbox, python: str) -> None:
    result = await box.exec([python, "-c", "b = bytearray(10 * 1024**3); print(len(b))"])
    assert result.killed_by == KillReason.MEMORY, result
    assert classify(result) is ExecOutcome.MEMORY_LIMIT
    assert "MemoryError" in result.stderr and result.stdout == ""
    assert_worker_healthy()


async def test_file_size_limit(local_provider: LocalSandboxProvider) -> None:
    limits = dataclasses.replace(SMALL, disk_mb=1)
    async with local_provider.create(labels={"t": "disk"}, limits=limits) as disk_box:
        result = await disk_box.exec("head -c 5000000 /dev/zero > big")
        assert result.killed_by == KillReason.DISK, result
        size = (await disk_box.exec("wc -c < big")).stdout.strip()
    assert int(size) <= 2**20


async def test_stop_leaves_no_process_behind(
    local_provider: LocalSandboxProvider, box: LocalSandbox
) -> None:
    tag = str(random.randrange(10**6, 10**7))  # tells this run's sleeps from others
    escapes = [
        f"sleep {tag}1 >/dev/null 2>&1 &",
        f"setsid sleep {tag}2 >/dev/null 2>&1 &",
        f"(sleep {tag}3 >/dev/null 2>&1 &) &",
        f"nohup sleep {tag}4 >/dev/null 2>&1 &",
    ]
    tracked_without_marker = (
        local_provider.containment.identity == "dedicated" or box.cgroup is not None
    )
    if tracked_without_marker:  # only a uid or a cgroup can find a process that drops its env
        escapes.append(f"env -i setsid sleep {tag}5 >/dev/null 2>&1 &")
    started = await box.exec(" ".join(escapes))
    assert started.exit_code == 0, started.stderr
    deadline = time.monotonic() + 10
    pattern = b"sleep\x00" + tag.encode()
    while len(processes_with_cmdline(pattern)) < len(escapes):
        assert time.monotonic() < deadline, "the background sleeps never started"
        await asyncio.sleep(0.05)
    await box.stop()
    assert processes_with_cmdline(pattern) == set()
    assert sandbox_processes(box) == set()
    assert not box.path.exists()
    if box.cgroup is not None:
        assert not box.cgroup.track_dir.exists()


async def test_dedicated_uids_differ_and_own_written_files(
    local_provider: LocalSandboxProvider, box: LocalSandbox
) -> None:
    if local_provider.containment.identity != "dedicated":
        pytest.skip("needs a root worker with dedicated uids")
    async with local_provider.create(labels={"t": "other"}, limits=SMALL) as other:
        assert other.uid != box.uid
        await box.write_file("mine.txt", "x")
        assert (Path(box.workdir) / "mine.txt").stat().st_uid == box.uid
        cross = await other.exec(["cat", f"{box.workdir}/mine.txt"])
        assert cross.exit_code != 0  # another sandbox's uid cannot read this one's files


async def test_a_symlink_swapped_in_after_the_check_is_refused(
    box: LocalSandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    await box.write_file("d/f.txt", "inside")
    stale = _paths.resolve_inside(box.workdir, "d/passwd")
    await box.exec("rm -r d && ln -s /etc d")  # the race, made deterministic
    monkeypatch.setattr(_paths, "resolve_inside", lambda workdir, path: stale)
    with pytest.raises(SandboxEscape, match="changed while it was opened"):
        await box.read_file("d/passwd")
    with pytest.raises(SandboxEscape, match="changed while it was opened"):
        await box.write_file("d/passwd", "pwned")


async def test_reaping_the_sandboxes_of_a_crashed_worker(sandbox_root: Path) -> None:
    duration = str(random.randrange(10**6, 10**7))  # tells this run's sleeps from others
    script = textwrap.dedent(
        f"""
        import asyncio, json, os
        from pathlib import Path
        from engine.sandbox import LocalSandboxConfig, LocalSandboxProvider

        async def main():
            provider = LocalSandboxProvider(LocalSandboxConfig(root=Path({str(sandbox_root)!r})))
            ids = []
            for sample in ("a", "b"):
                labels = {{"rollout.worker": "crashy", "rollout.sample": sample}}
                box = provider.create(labels=labels)
                await box.start()
                await box.exec("sleep {duration} >/dev/null 2>&1 &")
                ids.append(box.id)
            print(json.dumps(ids), flush=True)
            os._exit(1)  # crash: no stop(), no close()

        asyncio.run(main())
        """
    )
    repo = Path(__file__).resolve().parents[2]
    crashed = subprocess.run(
        [sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert crashed.returncode == 1, crashed.stderr
    ids = json.loads(crashed.stdout)
    assert len(processes_with_cmdline(b"sleep\x00" + duration.encode())) == 2

    survivor = LocalSandboxProvider(LocalSandboxConfig(root=sandbox_root))
    try:
        assert sorted(await survivor.find({"rollout.worker": "crashy"})) == sorted(ids)
        assert await survivor.reap({"rollout.worker": "crashy"}) == 2
    finally:
        survivor.close()
    assert processes_with_cmdline(b"sleep\x00" + duration.encode()) == set()
    assert [p.name for p in sandbox_root.iterdir() if not p.name.startswith(".")] == []
    uids = sandbox_root / ".uids"
    assert not uids.exists() or list(uids.iterdir()) == []


async def test_setup_failures_are_sandbox_errors(
    local_provider: LocalSandboxProvider, box: LocalSandbox
) -> None:
    await box.exec("true")
    Path(box.workdir).rename(box.path / "moved")  # the workdir vanished under the sandbox
    with pytest.raises(SandboxError, match="chdir"):
        await box.exec("true")
    (box.path / "moved").rename(box.workdir)
