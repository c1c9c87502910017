"""The docker SDK at the adapter's edge: imported on first use, and every docker or
connection failure translated to :class:`~engine.errors.SandboxError` naming what was being
done (``requests`` errors derive from ``OSError``, which covers a dead socket)."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from engine.errors import SandboxError

__all__ = ["call", "docker_module", "is_not_found", "tar_archive", "translate"]

_T = TypeVar("_T")


def docker_module() -> Any:
    try:
        import docker
    except ImportError as exc:  # pragma: no cover - docker is a declared dependency
        raise SandboxError(
            "the docker sandbox backend needs the 'docker' package (pip install docker)"
        ) from exc
    return docker


def translate(what: str, exc: BaseException) -> SandboxError:
    docker = docker_module()
    if isinstance(exc, docker.errors.ImageNotFound):
        return SandboxError(f"{what}: docker image not found ({exc.explanation})")
    if isinstance(exc, docker.errors.NotFound):
        return SandboxError(f"{what}: not found on the docker daemon ({exc.explanation})")
    if isinstance(exc, docker.errors.APIError):
        return SandboxError(f"{what}: docker answered {exc.status_code}: {exc.explanation}")
    return SandboxError(f"{what}: docker daemon unreachable or failing: {exc}")


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, docker_module().errors.NotFound)


async def call(what: str, function: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run a blocking SDK call in a thread, its errors translated."""
    docker = docker_module()
    try:
        return await asyncio.to_thread(function, *args, **kwargs)
    except (docker.errors.DockerException, OSError) as exc:
        raise translate(what, exc) from exc


def tar_archive(
    members: Sequence[tuple[str, bytes | None, int]], *, owner: tuple[int, int]
) -> bytes:
    """A tar of ``(name, data, mode)`` members owned by ``owner``; ``data=None`` is a directory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.mode = mode
            info.uid, info.gid = owner
            info.mtime = int(time.time())
            if data is None:
                info.type = tarfile.DIRTYPE
                archive.addfile(info)
            else:
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
