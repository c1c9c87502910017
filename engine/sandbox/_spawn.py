"""Worker side of the supervisor (``_init.py``): spawn a command, capture it, wait for it.

:class:`Supervisor` owns one supervisor process, started on first use and again if it died; a
daemon thread reads its replies and hands them to the waiting loop, so one supervisor serves
callers on any event loop. :func:`run_command` is one exec.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import SandboxError

_INIT = str(Path(__file__).with_name("_init.py"))
_REAP_GRACE_S = 30.0
_SUPERVISOR_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


@dataclass(frozen=True, slots=True)
class _Pending:
    loop: asyncio.AbstractEventLoop
    started: asyncio.Future[int]
    exited: asyncio.Future[int]

    def resolve(self, future: asyncio.Future[int], value: Any, error: Exception | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, future, value, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more


@dataclass(frozen=True, slots=True)
class Spawned:
    pid: int  # leads the command's session and process group
    exited: asyncio.Future[int]  # os.waitstatus_to_exitcode: negative for a signal


class Supervisor:

    def __init__(self, python: str) -> None:
        self._python = python
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._pending: dict[int, tuple[socket.socket, _Pending]] = {}
        self._next_id = 0

    @property
    def pid(self) -> int | None:
        return None if self._proc is None or self._sock is None else self._proc.pid

    def _ensure_started(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(
                [self._python, "-I", "-S", _INIT, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # it may outlive the worker: hold none of its pipes
                start_new_session=True,
                cwd="/",
                env=_SUPERVISOR_ENV,
            )
        except OSError as exc:
            ours.close()
            raise SandboxError(
                f"could not start the sandbox supervisor with {self._python}: {exc}"
            ) from exc
        finally:
            theirs.close()
        self._proc, self._sock = proc, ours
        reader = threading.Thread(
            target=self._read_replies, args=(ours, proc), name="sandbox-supervisor", daemon=True
        )
        reader.start()
        return ours

    def _read_replies(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        buffer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                self._dispatch(json.loads(line))
        sock.close()
        code = proc.wait()
        with self._lock:
            if self._sock is sock:
                self._sock = None
            orphans = [pending for owner, pending in self._pending.values() if owner is sock]
            for request_id in [key for key, (owner, _) in self._pending.items() if owner is sock]:
                del self._pending[request_id]
        error = SandboxError(f"the sandbox supervisor (pid {proc.pid}) exited with status {code}")
        for pending in orphans:
            pending.resolve(pending.started, None, error)
            pending.resolve(pending.exited, None, error)

    def _dispatch(self, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        if not isinstance(request_id, int):
            return
        with self._lock:
            entry = self._pending.get(request_id)
            if entry is not None and ("status" in message or "error" in message):
                del self._pending[request_id]
        if entry is None:
            return
        pending = entry[1]
        if "pid" in message:
            pending.resolve(pending.started, int(message["pid"]), None)
        elif "status" in message:
            pending.resolve(pending.exited, int(message["status"]), None)
        else:
            error = SandboxError(f"the sandbox supervisor could not fork: {message.get('error')}")
            pending.resolve(pending.started, None, error)
            pending.resolve(pending.exited, None, error)

    async def spawn(
        self,
        *,
        argv: Sequence[str],
        env: dict[str, str],
        spec: dict[str, object],
        fds: Sequence[int],
    ) -> Spawned:
        """Start a command; ``fds`` are its stdin, stdout, stderr and error pipe."""
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future(), loop.create_future())

        def send() -> None:
            with self._lock:
                sock = self._ensure_started()
                self._next_id += 1
                request_id = self._next_id
                body = json.dumps(
                    {"id": request_id, "argv": list(argv), "env": env, "spec": spec}
                ).encode()
                data = len(body).to_bytes(4, "big") + body
                self._pending[request_id] = (sock, pending)
                try:
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    sent = sock.sendmsg([data], rights)
                    if sent < len(data):
                        sock.sendall(data[sent:])
                except OSError as exc:
                    del self._pending[request_id]
                    raise SandboxError(f"could not reach the sandbox supervisor: {exc}") from exc

        await asyncio.to_thread(send)
        pid = await pending.started
        return Spawned(pid, pending.exited)

    async def spawn_detached(
        self, *, argv: Sequence[str], env: dict[str, str], spec: dict[str, object]
    ) -> int:
        """Start a process with no I/O that nobody waits for (it is killed by marker or pgid);
        returns its pid once it has exec'd, or raises ``SandboxError`` with the setup error."""
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        diag_r, diag_w = os.pipe()
        try:
            fds = [null, null, null, diag_w]
            spawned = await self.spawn(argv=argv, env=env, spec=spec, fds=fds)
        except BaseException:
            os.close(diag_r)
            raise
        finally:
            os.close(null)
            os.close(diag_w)
        spawned.exited.add_done_callback(_retrieve)
        setup_error = await asyncio.to_thread(_read_all, diag_r)
        if setup_error:
            raise SandboxError(setup_error)
        return spawned.pid

    def close(self) -> None:
        """Stop accepting commands; the supervisor exits once its children are gone."""
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()  # nobody waits for a detached process: its end is not an error


class Capture(asyncio.Protocol):
    """Keeps the first ``limit`` bytes of a pipe and notes whether more came."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.truncated = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def factory(self) -> Capture:
        return self

    def data_received(self, data: bytes) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            self.data += data[:room]
        if len(data) > room:
            self.truncated = True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Finished:
    status: int  # os.waitstatus_to_exitcode: negative for a signal
    stdout: Capture
    stderr: Capture
    timed_out: bool
    elapsed_s: float


def _read_all(fd: int) -> str:
    chunks = []
    try:
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", "replace")


@dataclass(slots=True)
class _Pipes:
    """One command's pipes: ``child_fds`` are the ends the command gets (stdin, stdout,
    stderr, error pipe), closed here once it has them; ``diag_r`` reads the error pipe."""

    captures: tuple[Capture, Capture]
    transports: list[asyncio.BaseTransport] = field(default_factory=list)
    writer: asyncio.WriteTransport | None = None
    child_fds: list[int] = field(default_factory=list)
    diag_r: int = -1

    @classmethod
    async def open(cls, stdin: bytes | None, max_output_bytes: int) -> _Pipes:
        loop = asyncio.get_running_loop()
        pipes = cls((Capture(max_output_bytes), Capture(max_output_bytes)))
        stdin_w = -1
        try:
            if stdin is None:
                pipes.child_fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
            else:
                stdin_r, stdin_w = os.pipe()
                pipes.child_fds.append(stdin_r)
            for capture in pipes.captures:
                read_end, write_end = os.pipe()
                pipes.child_fds.append(write_end)
                reader, _ = await loop.connect_read_pipe(
                    capture.factory, os.fdopen(read_end, "rb", buffering=0)
                )
                pipes.transports.append(reader)
            pipes.diag_r, diag_w = os.pipe()
            pipes.child_fds.append(diag_w)
            if stdin_w >= 0:
                pipes.writer, _ = await loop.connect_write_pipe(
                    asyncio.BaseProtocol, os.fdopen(stdin_w, "wb", buffering=0)
                )
                pipes.transports.append(pipes.writer)
                stdin_w = -1
        except BaseException:
            pipes.close()
            if stdin_w >= 0:
                os.close(stdin_w)
            raise
        return pipes

    def close_child_ends(self) -> None:
        for fd in self.child_fds:
            os.close(fd)
        self.child_fds.clear()

    def close(self) -> None:
        for transport in self.transports:
            transport.close()
        self.close_child_ends()
        if self.diag_r >= 0:
            os.close(self.diag_r)


async def _wait(
    spawned: Spawned, argv: Sequence[str], timeout: float, kill: Callable[[int], Awaitable[None]]
) -> tuple[int, bool]:
    try:
        return await asyncio.wait_for(asyncio.shield(spawned.exited), timeout), False
    except TimeoutError:
        pass
    await kill(spawned.pid)
    try:
        return await asyncio.wait_for(asyncio.shield(spawned.exited), _REAP_GRACE_S), True
    except TimeoutError:
        raise SandboxError(
            f"command {argv[0]!r} (pid {spawned.pid}) survived SIGKILL for "
            f"{_REAP_GRACE_S:.0f}s (stuck in the kernel?)"
        ) from None


async def run_command(
    supervisor: Supervisor,
    *,
    argv: Sequence[str],
    env: dict[str, str],
    spec: dict[str, object],
    stdin: bytes | None,
    timeout: float,
    max_output_bytes: int,
    drain_grace_s: float,
    on_started: Callable[[int], Awaitable[None]],
    kill: Callable[[int], Awaitable[None]],
) -> Finished:
    """Run one command to its end, or kill it at ``timeout``; ``SandboxError`` saying why
    when the supervisor could not set it up."""
    pipes = await _Pipes.open(stdin, max_output_bytes)
    try:
        started = time.monotonic()
        try:
            spawned = await supervisor.spawn(argv=argv, env=env, spec=spec, fds=pipes.child_fds)
        finally:
            pipes.close_child_ends()
    except BaseException:
        pipes.close()
        raise
    stdout, stderr = pipes.captures
    try:
        await on_started(spawned.pid)
        if pipes.writer is not None and stdin is not None:
            pipes.writer.write(stdin)
            pipes.writer.close()  # closes once the child has taken everything
        status, timed_out = await _wait(spawned, argv, timeout, kill)
        elapsed = time.monotonic() - started
        try:
            await asyncio.wait_for(asyncio.gather(stdout.closed, stderr.closed), drain_grace_s)
        except TimeoutError:
            pass  # background processes still hold the pipes; they get EPIPE from now on
    except BaseException:
        await kill(spawned.pid)  # cancelled, or the supervisor died: nothing may outlive it
        raise
    finally:
        for transport in pipes.transports:
            transport.close()
        setup_error = await asyncio.to_thread(_read_all, pipes.diag_r)
    if setup_error:
        raise SandboxError(setup_error)
    return Finished(status, stdout, stderr, timed_out, elapsed)
