"""Files of a Docker sandbox, through the archive endpoints, kept inside the working directory.

A path is resolved one component at a time with the archive endpoint's ``stat``, which reports
a symlink's resolved target inside the container; a target outside the working directory
raises :class:`~engine.errors.SandboxEscape`, the local backend's contract. A command can change
the tree between check and copy; the worst it reaches is another path of its own container.
Reads take a regular file of at most ``max_file_bytes``; a write sends one tar with the missing
parent directories and the file, owned by the exec user.
"""

from __future__ import annotations

import base64
import io
import json
import posixpath
import tarfile
from dataclasses import dataclass
from typing import Any

from engine.errors import SandboxError, SandboxEscape
from engine.sandbox._docker_api import call, tar_archive

__all__ = ["ArchiveFiles", "Resolved"]

# Go's os.FileMode type bits, as the archive stat header reports them.
_MODE_DIR = 1 << 31
_MODE_SYMLINK = 1 << 27
_MODE_TYPE = _MODE_DIR | _MODE_SYMLINK | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)


@dataclass(frozen=True, slots=True)
class Resolved:
    """A resolved path: its stat (``None`` if missing), the deepest existing directory on the
    way (``base``) and the components missing below it."""

    path: str
    stat: dict[str, Any] | None
    base: str
    missing: list[str]


class ArchiveFiles:
    """File access to one container, confined to ``workdir``."""

    def __init__(
        self,
        *,
        client: Any,
        container: Any,
        workdir: str,
        owner: tuple[int, int],
        sandbox_id: str,
        max_file_bytes: int,
    ) -> None:
        self._client = client
        self._container = container
        self._workdir = workdir
        self._owner = owner
        self._id = sandbox_id
        self._max_file_bytes = max_file_bytes

    def _inside(self, path: str) -> bool:
        return path == self._workdir or path.startswith(self._workdir.rstrip("/") + "/")

    def _stat_sync(self, path: str) -> dict[str, Any] | None:
        """The archive endpoint's stat of ``path`` (the SDK has no public call for HEAD)."""
        api = self._client.api
        response = api.head(
            api._url("/containers/{0}/archive", self._container.id), params={"path": path}
        )
        if response.status_code == 404:
            return None
        api._raise_for_status(response)
        header = response.headers.get("X-Docker-Container-Path-Stat")
        if not header:
            raise SandboxError(f"sandbox {self._id}: docker sent no stat for {path!r}")
        stat: dict[str, Any] = json.loads(base64.b64decode(header))
        return stat

    async def _stat(self, path: str) -> dict[str, Any] | None:
        return await call(f"sandbox {self._id}: stat {path!r}", self._stat_sync, path)

    def _outside(self, path: str, resolved: str) -> SandboxEscape:
        return SandboxEscape(
            f"path {path!r} resolves to {resolved}, outside the sandbox workdir {self._workdir}"
        )

    async def _resolve(self, path: str) -> Resolved:
        if not isinstance(path, str) or not path or "\0" in path:
            raise SandboxError(f"sandbox path must be a non-empty string without NUL, got {path!r}")
        if posixpath.isabs(path):
            if not self._inside(posixpath.normpath(path)):
                raise SandboxEscape(
                    f"path {path!r} is absolute and outside the sandbox workdir {self._workdir}"
                )
            relative = posixpath.relpath(posixpath.normpath(path), self._workdir)
        else:
            relative = path
        components = [part for part in relative.split("/") if part not in ("", ".")]
        current = self._workdir
        stat: dict[str, Any] | None = {"mode": _MODE_DIR}
        for index, component in enumerate(components):
            if component == "..":
                current = posixpath.dirname(current)
                if not self._inside(current):
                    raise self._outside(path, current)
                continue
            if stat is not None and not int(stat.get("mode", 0)) & _MODE_DIR:
                raise SandboxError(f"path {path!r}: {current} is not a directory")
            candidate = posixpath.join(current, component)
            stat = await self._stat(candidate)
            if stat is None:
                missing = components[index:]
                resolved = posixpath.normpath(posixpath.join(current, *missing))
                if not self._inside(resolved):
                    raise self._outside(path, resolved)
                if ".." in missing:
                    raise SandboxError(f"path {path!r}: {candidate} does not exist")
                return Resolved(resolved, None, current, missing)
            if int(stat.get("mode", 0)) & _MODE_SYMLINK:
                target = posixpath.normpath(str(stat.get("linkTarget") or ""))
                if not self._inside(target):
                    raise SandboxEscape(
                        f"path {path!r}: {candidate} is a symlink to {target}, outside the "
                        f"sandbox workdir {self._workdir}"
                    )
                candidate = target
                stat = await self._stat(candidate)
                if stat is None:
                    if index != len(components) - 1:
                        raise SandboxError(f"path {path!r}: {candidate} does not exist")
                    base = posixpath.dirname(candidate)
                    return Resolved(candidate, None, base, [posixpath.basename(candidate)])
            current = candidate
        return Resolved(current, stat, posixpath.dirname(current), [])

    async def read(self, path: str) -> bytes:
        container = self._container
        found = await self._resolve(path)
        resolved, stat = found.path, found.stat
        if stat is None:
            raise SandboxError(f"path {path!r} does not exist in sandbox {self._id}")
        mode = int(stat.get("mode", 0))
        if mode & _MODE_TYPE:
            raise SandboxError(f"path {path!r} in sandbox {self._id} is not a regular file")
        size = int(stat.get("size", 0))
        if size > self._max_file_bytes:
            raise SandboxError(
                f"path {path!r} is {size} bytes, over the {self._max_file_bytes}-byte read limit"
            )

        limit = self._max_file_bytes + 2**20  # the file plus tar headers and padding

        def fetch() -> bytes:
            stream, _ = container.get_archive(resolved)
            chunks, size = [], 0
            for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise SandboxError(f"path {path!r} grew past the read limit while read")
                chunks.append(chunk)
            return b"".join(chunks)

        archive = await call(f"sandbox {self._id}: reading {path!r}", fetch)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise SandboxError(f"path {path!r} in sandbox {self._id} is not a regular file")
            extracted = tar.extractfile(member)
            assert extracted is not None
            return extracted.read()

    async def write(self, path: str, payload: bytes, mode: int) -> None:
        container = self._container
        found = await self._resolve(path)
        resolved, stat, base, missing = found.path, found.stat, found.base, found.missing
        if resolved == self._workdir:
            raise SandboxError(f"path {path!r} is the sandbox workdir itself, not a file")
        if stat is not None and int(stat.get("mode", 0)) & _MODE_TYPE:
            raise SandboxError(f"path {path!r} in sandbox {self._id} is not a regular file")
        if stat is not None:
            base, missing = posixpath.dirname(resolved), [posixpath.basename(resolved)]
        parents = [("/".join(missing[:depth]), None, 0o755) for depth in range(1, len(missing))]
        archive = tar_archive([*parents, ("/".join(missing), payload, mode)], owner=self._owner)
        await call(f"sandbox {self._id}: writing {path!r}", container.put_archive, base, archive)
