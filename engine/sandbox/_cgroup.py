"""Optional cgroups for the local sandbox: exact process and memory accounting.

Over rlimits they add: ``pids.max`` bounds a sandbox's processes in total (``RLIMIT_NPROC``
counts per uid), the memory limit bounds its resident memory in total (``RLIMIT_DATA`` is per
process), the kernel counts hits of both (results are classified from counters, not error
text), and each exec gets a child group, so a timed-out command dies with every descendant,
even ones that left its process group or cleared their environment.

Usable with cgroup v1 writable ``pids``/``memory`` hierarchies (groups go in a
``rollout-sandboxes`` folder under the worker's own cgroup), or with cgroup v2 only given a
``cgroup_parent`` delegated to the worker and holding no processes: the kernel refuses to
enable controllers below a cgroup that has processes, so the worker's own v2 cgroup cannot
serve. Otherwise :func:`detect` returns ``None`` and why; the sandbox relies on uid and rlimits.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.sandbox.base import SandboxLimits

_GROUP_FOLDER = "rollout-sandboxes"


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """Parent folders of sandbox groups per hierarchy (v2: the same folder)."""

    version: int
    pids_parent: Path | None
    memory_parent: Path | None

    def describe(self) -> str:
        parts = []
        if self.pids_parent is not None:
            parts.append(f"pids under {self.pids_parent}")
        if self.memory_parent is not None:
            parts.append(f"memory under {self.memory_parent}")
        return f"cgroup v{self.version}: " + ", ".join(parts)


@dataclass(frozen=True, slots=True)
class CgroupCounters:
    pids_max_hits: int = 0
    oom_kills: int = 0


def _mounts() -> Iterator[tuple[str, Path, str, set[str]]]:
    """(root, mount point, fstype, super options) of each cgroup mount."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields = head.split()
        tail_fields = tail.split()
        if len(fields) < 5 or len(tail_fields) < 3:
            continue
        fstype = tail_fields[0]
        if fstype in ("cgroup", "cgroup2"):
            yield fields[3], Path(fields[4]), fstype, set(tail_fields[2].split(","))


def _own_paths() -> dict[str, str]:
    """Controller name (``""`` for v2) -> the worker's cgroup path in that hierarchy."""
    own: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return own
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            own[controller] = parts[2]
    return own


def _v1_dir(controller: str) -> Path | None:
    own = _own_paths().get(controller)
    if own is None:
        return None
    for root, mountpoint, fstype, options in _mounts():
        if fstype != "cgroup" or controller not in options:
            continue
        if root != "/" and not (own == root or own.startswith(root.rstrip("/") + "/")):
            continue
        relative = own[len(root) :] if root != "/" else own
        return mountpoint / relative.lstrip("/")
    return None


def _probe(parent: Path, limit_file: str, value: str) -> str | None:
    """Make ``parent``, then a child group whose limit we can write; ``None`` when it works."""
    probe = parent / f"probe-{os.getpid()}-{time.monotonic_ns()}"
    try:
        parent.mkdir(exist_ok=True)
        probe.mkdir()
    except OSError as exc:
        return f"cannot create a cgroup under {parent}: {exc.strerror}"
    try:
        (probe / limit_file).write_text(value)
    except OSError as exc:
        return f"cannot write {probe / limit_file}: {exc.strerror}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


def detect(v2_parent: Path | None = None) -> tuple[CgroupLayout | None, str]:
    """The cgroup layout this worker can use, or ``None`` and why not."""
    if v2_parent is not None:
        return _detect_v2(v2_parent)
    reasons: list[str] = []
    pids_parent: Path | None = None
    memory_parent: Path | None = None
    for controller, limit_file, value in (
        ("pids", "pids.max", "64"),
        ("memory", "memory.limit_in_bytes", str(64 * 2**20)),
    ):
        base = _v1_dir(controller)
        if base is None:
            reasons.append(f"no cgroup v1 {controller} hierarchy")
            continue
        parent = base / _GROUP_FOLDER
        failure = _probe(parent, limit_file, value)
        if failure is not None:
            reasons.append(failure)
        elif controller == "pids":
            pids_parent = parent
        else:
            memory_parent = parent
    if pids_parent is None and memory_parent is None:
        return None, "; ".join(reasons) or "no usable cgroup hierarchy"
    return CgroupLayout(1, pids_parent, memory_parent), "; ".join(reasons)


def _detect_v2(parent: Path) -> tuple[CgroupLayout | None, str]:
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
    except OSError as exc:
        return None, f"{parent} is not a cgroup v2 directory: {exc.strerror}"
    wanted = [name for name in ("pids", "memory") if name in available]
    if not wanted:
        return None, f"{parent}/cgroup.controllers offers neither pids nor memory"
    try:
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        missing = [name for name in wanted if name not in enabled]
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{name}" for name in missing))
    except OSError as exc:
        return None, (
            f"cannot enable {wanted} in {parent}/cgroup.subtree_control: {exc.strerror} "
            "(the parent must be delegated to this worker and hold no processes)"
        )
    limit_file = "pids.max" if "pids" in wanted else "memory.max"
    failure = _probe(parent, limit_file, "max")
    if failure is not None:
        return None, failure
    return (
        CgroupLayout(
            2,
            parent if "pids" in wanted else None,
            parent if "memory" in wanted else None,
        ),
        "",
    )


def _read_key(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_procs(group: Path) -> set[int]:
    pids: set[int] = set()
    for procs in group.rglob("cgroup.procs") if group.is_dir() else ():
        try:
            pids.update(int(line) for line in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return pids


def _rmdir_tree(group: Path) -> list[str]:
    """Remove a group and its child groups (deepest first); the failures, as messages."""
    if not group.is_dir():
        return []
    failures: list[str] = []
    children = sorted(
        (path for path in group.rglob("*") if path.is_dir()),
        key=lambda path: len(path.parts),
        reverse=True,
    )
    for path in [*children, group]:
        for attempt in range(50):
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY or attempt == 49:
                    failures.append(f"rmdir {path}: {exc.strerror}")
                    break
                time.sleep(0.02)
    return failures


@dataclass(frozen=True, slots=True)
class SandboxCgroup:
    """The groups of one sandbox: ``track_dir`` holds one child group per exec."""

    version: int
    pids_dir: Path | None
    memory_dir: Path | None

    @classmethod
    def create(cls, layout: CgroupLayout, sandbox_id: str, limits: SandboxLimits) -> SandboxCgroup:
        pids_dir = layout.pids_parent / sandbox_id if layout.pids_parent else None
        memory_dir = layout.memory_parent / sandbox_id if layout.memory_parent else None
        group = cls(layout.version, pids_dir, memory_dir)
        memory_bytes = str(limits.memory_mb * 2**20)
        try:
            for path in {p for p in (pids_dir, memory_dir) if p is not None}:
                path.mkdir()
            if pids_dir is not None:
                (pids_dir / "pids.max").write_text(str(limits.max_procs))
            if memory_dir is not None:
                if layout.version == 1:
                    (memory_dir / "memory.limit_in_bytes").write_text(memory_bytes)
                    memsw = memory_dir / "memory.memsw.limit_in_bytes"
                    if memsw.exists():
                        memsw.write_text(memory_bytes)
                else:
                    (memory_dir / "memory.max").write_text(memory_bytes)
                    swap = memory_dir / "memory.swap.max"
                    if swap.exists():
                        swap.write_text("0")
        except OSError as exc:
            group.remove()
            raise OSError(exc.errno, f"setting up cgroups for {sandbox_id}: {exc}") from exc
        return group

    @classmethod
    def from_json(cls, data: dict[str, object]) -> SandboxCgroup:
        pids = data.get("pids")
        memory = data.get("memory")
        version = data.get("version")
        return cls(
            version if isinstance(version, int) else 1,
            Path(pids) if isinstance(pids, str) else None,
            Path(memory) if isinstance(memory, str) else None,
        )

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version,
            "pids": str(self.pids_dir) if self.pids_dir else None,
            "memory": str(self.memory_dir) if self.memory_dir else None,
        }

    @property
    def track_dir(self) -> Path:
        track = self.pids_dir or self.memory_dir
        assert track is not None, "a SandboxCgroup has at least one hierarchy"
        return track

    def exec_group(self, number: int) -> list[str]:
        """Create exec ``number``'s group; the ``cgroup.procs`` files the launcher joins."""
        group = self.track_dir / f"e{number}"
        group.mkdir()
        procs = [str(group / "cgroup.procs")]
        if self.version == 1 and self.memory_dir is not None and self.memory_dir != self.track_dir:
            procs.append(str(self.memory_dir / "cgroup.procs"))
        return procs

    def exec_members(self, number: int) -> set[int]:
        return _read_procs(self.track_dir / f"e{number}")

    def members(self) -> set[int]:
        pids: set[int] = set()
        for path in {p for p in (self.pids_dir, self.memory_dir) if p is not None}:
            pids |= _read_procs(path)
        return pids

    def kill_exec(self, number: int) -> None:
        """cgroup v2's one-shot kill where the kernel has it; the caller loops otherwise."""
        kill_file = self.track_dir / f"e{number}" / "cgroup.kill"
        if self.version == 2 and kill_file.exists():
            try:
                kill_file.write_text("1")
            except OSError:
                pass

    def release_exec(self, number: int) -> None:
        """Drop an exec's group if nothing is left in it (background processes keep it)."""
        try:
            (self.track_dir / f"e{number}").rmdir()
        except OSError:
            pass

    def counters(self) -> CgroupCounters:
        pids_hits = 0
        oom_kills = 0
        if self.pids_dir is not None:
            pids_hits = _read_key(self.pids_dir / "pids.events", "max")
        if self.memory_dir is not None:
            if self.version == 1:
                oom_kills = _read_key(self.memory_dir / "memory.oom_control", "oom_kill")
            else:
                oom_kills = _read_key(self.memory_dir / "memory.events", "oom_kill")
        return CgroupCounters(pids_hits, oom_kills)

    def remove(self) -> list[str]:
        failures: list[str] = []
        for path in {p for p in (self.pids_dir, self.memory_dir) if p is not None}:
            failures += _rmdir_tree(path)
        return failures
