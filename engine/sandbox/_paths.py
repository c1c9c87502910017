"""Opening files beneath a sandbox's working directory without ever leaving it.

Two steps, because commands can change the tree while the worker works on it: ``realpath`` the
path and refuse anything that lands outside the working directory (symlinks that stay inside
are fine); then open the resolved path component by component from a descriptor of the working
directory with ``O_NOFOLLOW``. The resolved path has no symlinks left, so one met on the walk
was planted meanwhile and the call is refused: nothing is opened by a path a command could
redirect. A file with several hard links that the sandbox's uid does not own is refused too
(possible where ``fs.protected_hardlinks`` is off): the worker, maybe root, must not touch it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePosixPath

from engine.errors import SandboxError, SandboxEscape

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def resolve_inside(workdir: str, path: str) -> list[str]:
    """The components of ``path`` (relative to ``workdir`` or absolute inside it) below
    ``workdir`` after resolving symlinks; ``SandboxEscape`` when it resolves outside."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise SandboxError(f"sandbox path must be a non-empty string without NUL, got {path!r}")
    base = os.path.realpath(workdir)
    if os.path.isabs(path):
        candidate = os.path.normpath(path)
        roots = {base, os.path.normpath(workdir)}
        if not any(candidate == root or candidate.startswith(root + "/") for root in roots):
            raise SandboxEscape(
                f"path {path!r} is absolute and outside the sandbox workdir {workdir}"
            )
        joined = path
    else:
        joined = os.path.join(base, path)
    resolved = os.path.realpath(joined)
    if resolved != base and not resolved.startswith(base + "/"):
        raise SandboxEscape(
            f"path {path!r} resolves to {resolved}, outside the sandbox workdir {workdir}"
        )
    parts = list(PurePosixPath(os.path.relpath(resolved, base)).parts)
    return [] if parts == ["."] else parts


def _escape_during_walk(path: str, component: str, exc: OSError) -> SandboxEscape:
    return SandboxEscape(
        f"path {path!r} changed while it was opened: {component!r} is now a symlink or not a "
        f"directory ({exc.strerror})"
    )


def _check_links(path: str, st: os.stat_result, uid: int | None) -> None:
    if uid is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and st.st_uid != uid:
        raise SandboxEscape(
            f"path {path!r} is a hard link to a file owned by uid {st.st_uid}, not the "
            f"sandbox's uid {uid}; refusing to touch it"
        )


def _walk_dirs(
    base_fd: int, parts: list[str], path: str, *, create: bool, owner: tuple[int, int] | None
) -> int:
    """A descriptor of the directory ``parts`` names under ``base_fd`` (created if asked)."""
    fd = os.dup(base_fd)
    try:
        for component in parts:
            try:
                next_fd = os.open(component, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise SandboxError(
                        f"path {path!r}: directory {component!r} does not exist"
                    ) from None
                try:
                    os.mkdir(component, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                next_fd = os.open(component, _DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    os.fchown(next_fd, *owner)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _escape_during_walk(path, component, exc) from exc
                raise
            os.close(fd)
            fd = next_fd
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_beneath(workdir: str, path: str, *, uid: int | None, max_bytes: int) -> bytes:
    """Contents of the regular file ``path`` inside ``workdir`` (at most ``max_bytes``)."""
    parts = resolve_inside(workdir, path)
    if not parts:
        raise SandboxError(f"path {path!r} is the sandbox workdir itself, not a file")
    base_fd = os.open(workdir, _DIR_FLAGS)
    try:
        dir_fd = _walk_dirs(base_fd, parts[:-1], path, create=False, owner=None)
    finally:
        os.close(base_fd)
    try:
        try:
            fd = os.open(
                parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                dir_fd=dir_fd,
            )
        except FileNotFoundError:
            raise SandboxError(f"path {path!r} does not exist in the sandbox") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _escape_during_walk(path, parts[-1], exc) from exc
            raise
    finally:
        os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SandboxError(f"path {path!r} is not a regular file")
    with os.fdopen(fd, "rb") as handle:
        _check_links(path, st, uid)
        if st.st_size > max_bytes:
            raise SandboxError(
                f"path {path!r} is {st.st_size} bytes, over the {max_bytes}-byte read limit"
            )
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise SandboxError(f"path {path!r} grew past the {max_bytes}-byte read limit while read")
    return data


def write_beneath(
    workdir: str,
    path: str,
    data: bytes,
    *,
    mode: int,
    owner: tuple[int, int] | None,
) -> None:
    """Write ``data`` to ``path`` inside ``workdir``, creating parent directories."""
    if not 0 <= mode <= 0o7777:
        raise SandboxError(f"file mode for {path!r} must be within 0o0..0o7777, got {mode!r}")
    parts = resolve_inside(workdir, path)
    if not parts:
        raise SandboxError(f"path {path!r} is the sandbox workdir itself, not a file")
    base_fd = os.open(workdir, _DIR_FLAGS)
    try:
        dir_fd = _walk_dirs(base_fd, parts[:-1], path, create=True, owner=owner)
    finally:
        os.close(base_fd)
    try:
        try:
            fd = os.open(
                parts[-1],
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                mode & 0o777,
                dir_fd=dir_fd,
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _escape_during_walk(path, parts[-1], exc) from exc
            if exc.errno == errno.EISDIR:
                raise SandboxError(f"path {path!r} is a directory") from exc
            raise
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "wb") as handle:
        st = os.fstat(handle.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise SandboxError(f"path {path!r} is not a regular file")
        _check_links(path, st, owner[0] if owner else None)
        os.ftruncate(handle.fileno(), 0)
        if owner is not None:
            os.fchown(handle.fileno(), *owner)
        os.fchmod(handle.fileno(), mode)
        handle.write(data)
