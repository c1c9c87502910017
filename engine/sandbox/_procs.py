"""Finding and killing a sandbox's processes through ``/proc``.

A sandbox's processes are those with its own uid (if it has one), those carrying its environment
markers (``ROLLOUT_SANDBOX_ID=<id>``, ``ROLLOUT_SANDBOX_EXEC=<id>/<n>``; inherited even across
``setsid``), its cgroup's, and recorded process groups that still hold a marked member; zombies
are already dead and ignored. Killing repeats "find, SIGKILL all" until nothing is found: a
killed process forks no more and the process limit bounds what appears between scans.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

SANDBOX_MARKER = "ROLLOUT_SANDBOX_ID"
EXEC_MARKER = "ROLLOUT_SANDBOX_EXEC"

_PROC = "/proc"


@dataclass(frozen=True, slots=True)
class ProcInfo:
    pid: int
    state: str
    pgid: int
    uids: tuple[int, ...]


def iter_pids() -> Iterator[int]:
    try:
        names = os.listdir(_PROC)
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def proc_info(pid: int) -> ProcInfo | None:
    """State, process group and uids (real, effective, saved, fs) of a process."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as handle:
            stat = handle.read()
        with open(f"{_PROC}/{pid}/status", "rb") as handle:
            status = handle.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses; the fields after the last ')' are fixed.
    rest = stat[stat.rfind(b")") + 2 :].split()
    if len(rest) < 3:
        return None
    uids: tuple[int, ...] = ()
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            uids = tuple(int(field) for field in line.split()[1:])
            break
    return ProcInfo(pid=pid, state=rest[0].decode(), pgid=int(rest[2]), uids=uids)


def has_env(pid: int, entry: bytes) -> bool:
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as handle:
            environ = handle.read()
    except OSError:
        return False
    return entry in environ.split(b"\0")


def marker(key: str, value: str) -> bytes:
    return f"{key}={value}".encode()


def find_processes(
    *,
    uid: int | None = None,
    env_entry: bytes | None = None,
    pgids: Iterable[int] = (),
    exclude: Iterable[int] = (),
) -> set[int]:
    """Live (non-zombie) pids that have ``uid``, carry ``env_entry``, or sit in a process group
    of ``pgids`` that has at least one member carrying ``env_entry`` or ``uid``."""
    skip = {os.getpid(), *exclude}
    wanted_groups = set(pgids)
    found: set[int] = set()
    by_group: dict[int, list[int]] = {}
    for pid in iter_pids():
        if pid in skip:
            continue
        info = proc_info(pid)
        if info is None or info.state in ("Z", "X"):
            continue
        ours = (uid is not None and uid in info.uids) or (
            env_entry is not None and has_env(pid, env_entry)
        )
        if ours:
            found.add(pid)
        if info.pgid in wanted_groups:
            by_group.setdefault(info.pgid, []).append(pid)
    for members in by_group.values():
        if any(pid in found for pid in members):
            found.update(members)
    return found


def kill_all(pids: Iterable[int]) -> int:
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


async def kill_until_gone(find: Callable[[], set[int]], *, deadline_s: float = 10.0) -> set[int]:
    """SIGKILL whatever ``find`` returns until it returns nothing; return the survivors at the
    deadline (normally none)."""
    end = time.monotonic() + deadline_s
    while True:
        found = await asyncio.to_thread(find)
        if not found or time.monotonic() > end:
            return found
        kill_all(found)
        await asyncio.sleep(0.02)


def count_tasks_of_uid(uid: int) -> int:
    """Processes plus threads whose real uid is ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    total = 0
    for pid in iter_pids():
        try:
            with open(f"{_PROC}/{pid}/status", "rb") as handle:
                status = handle.read()
        except OSError:
            continue
        real_uid = -1
        threads = 1
        for line in status.splitlines():
            if line.startswith(b"Uid:"):
                real_uid = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
        if real_uid == uid:
            total += threads
    return total
