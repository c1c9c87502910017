"""The on-disk side of local sandboxes: ``sandbox.json``, uid locks, and destruction.

Everything another worker needs to find, kill and remove a sandbox lives on disk, written by the
worker (root-owned, mode 0600, in a folder the sandbox's uid cannot write), so a crashed worker's
sandboxes are reaped from their records alone. See :mod:`engine.sandbox.local` for the layout.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import SandboxError
from engine.sandbox import _procs
from engine.sandbox._cgroup import SandboxCgroup
from engine.sandbox._local_config import Identity

__all__ = [
    "RECORD",
    "UIDS",
    "SandboxRecord",
    "claim_uid",
    "destroy",
    "force_rmtree",
    "matching_records",
    "release_uid",
]

RECORD = "sandbox.json"
UIDS = ".uids"


def force_rmtree(path: Path) -> None:
    """Remove a tree even where a command left directories without write or search bits."""

    def retry(function: Callable[..., Any], target: str, _exc: object) -> None:
        parent = os.path.dirname(target)
        for directory in (parent, target):
            try:
                os.chmod(directory, 0o700, follow_symlinks=False)
            except OSError:
                pass
        try:
            function(target)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            shutil.rmtree(target, onerror=retry)

    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, onerror=retry)


@dataclass(slots=True)
class SandboxRecord:
    """``sandbox.json``: everything another worker needs to kill and remove this sandbox."""

    id: str
    labels: dict[str, str]
    path: str
    identity: Identity
    uid: int | None = None
    gid: int | None = None
    cgroup: dict[str, object] | None = None
    pgids: list[int] = field(default_factory=list)
    owner: str = ""
    created_at: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "format": 1,
            "backend": "local",
            "id": self.id,
            "labels": self.labels,
            "path": self.path,
            "identity": self.identity,
            "uid": self.uid,
            "gid": self.gid,
            "cgroup": self.cgroup,
            "pgids": self.pgids,
            "owner": self.owner,
            "created_at": self.created_at,
        }

    @classmethod
    def load(cls, directory: Path) -> SandboxRecord | None:
        try:
            data = json.loads((directory / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("backend") != "local":
            return None
        labels = data.get("labels")
        identity = data.get("identity")
        if not isinstance(labels, dict) or identity not in ("dedicated", "nobody", "inherit"):
            return None
        uid, gid, cgroup = data.get("uid"), data.get("gid"), data.get("cgroup")
        pgids = data.get("pgids")
        return cls(
            id=str(data.get("id")),
            labels={str(k): str(v) for k, v in labels.items()},
            path=str(directory),
            identity=identity,
            uid=uid if isinstance(uid, int) else None,
            gid=gid if isinstance(gid, int) else None,
            cgroup=cgroup if isinstance(cgroup, dict) else None,
            pgids=[p for p in pgids if isinstance(p, int)] if isinstance(pgids, list) else [],
            owner=str(data.get("owner", "")),
        )

    def save(self) -> None:
        directory = Path(self.path)
        tmp = directory / f".{RECORD}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_json(), handle)
        os.replace(tmp, directory / RECORD)


async def destroy(meta: SandboxRecord, *, uids_dir: Path, root: Path) -> list[str]:
    """Kill every process of a sandbox, remove its cgroups and directory, free its uid; return
    what could not be cleaned up."""
    group = SandboxCgroup.from_json(meta.cgroup) if meta.cgroup else None
    own_uid = meta.uid if meta.identity == "dedicated" else None
    if own_uid in (0, os.getuid(), os.geteuid()):
        own_uid = None  # a damaged sandbox.json must never make us kill our own uid's processes
    entry = _procs.marker(_procs.SANDBOX_MARKER, meta.id)

    def find() -> set[int]:
        found = _procs.find_processes(uid=own_uid, env_entry=entry, pgids=meta.pgids)
        if group is not None:
            found |= group.members()
        return found

    problems: list[str] = []
    survivors = await _procs.kill_until_gone(find)
    if survivors:
        problems.append(f"processes {sorted(survivors)} survived SIGKILL")
    if group is not None:
        problems += await asyncio.to_thread(group.remove)
    directory = Path(meta.path)
    if directory.parent != root or not directory.name:
        problems.append(f"refusing to remove {directory}: not a sandbox folder under {root}")
    else:
        try:
            await asyncio.to_thread(force_rmtree, directory)
        except OSError as exc:
            problems.append(f"removing {directory}: {exc}")
    if own_uid is not None:
        release_uid(uids_dir, own_uid, meta.id)
    return problems


def release_uid(uids_dir: Path, uid: int, sandbox_id: str) -> None:
    lock = uids_dir / str(uid)
    try:
        if lock.read_text() == sandbox_id:  # the uid may already belong to a newer sandbox
            lock.unlink()
    except OSError:
        pass


def claim_uid(uids_dir: Path, sandbox_id: str, base: int, count: int) -> int:
    """A uid of ``base .. base+count-1`` that no sandbox holds and no process uses, claimed
    for ``sandbox_id`` with an exclusive lock file."""
    uids_dir.mkdir(mode=0o700, exist_ok=True)
    in_use: set[int] = set()
    for pid in _procs.iter_pids():
        info = _procs.proc_info(pid)
        if info is not None:
            in_use.update(info.uids)
    start = zlib.crc32(sandbox_id.encode()) % count
    for step in range(count):
        uid = base + (start + step) % count
        if uid in in_use:
            continue
        try:
            fd = os.open(uids_dir / str(uid), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(sandbox_id)
        return uid
    raise SandboxError(
        f"no free sandbox uid in {base}..{base + count - 1}: every one is held in {uids_dir}"
    )


def matching_records(root: Path, selector: Mapping[str, str]) -> list[SandboxRecord]:
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise SandboxError(f"cannot list sandbox root {root}: {exc.strerror}") from exc
    found = []
    for name in entries:
        if name.startswith("."):
            continue
        record = SandboxRecord.load(root / name)
        if record is not None and all(
            record.labels.get(key) == value for key, value in selector.items()
        ):
            found.append(record)
    return found
