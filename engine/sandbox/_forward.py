"""One endpoint inside a sandbox's network namespace, forwarded to one service outside.

A task that needs one service of the host (a scaffold reaching its recording proxy) gets a
socket listening on ``127.0.0.1:port`` *inside* the sandbox's namespace (a socket stays in the
namespace it was made in); the worker relays each connection to the target from its own
namespace, so commands reach exactly that target and nothing else of the host.
``setns(CLONE_NEWNET)`` changes only the calling thread, so it runs on a thread of its own that
ends right after: no pooled thread is ever left in a sandbox's namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import threading
from dataclasses import dataclass

from engine.errors import SandboxError
from engine.sandbox.base import Endpoint

CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)
_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class NetnsRef:
    """A network namespace: a process in it, and its inode (proof the pid was not reused)."""

    pid: int
    ino: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/ns/net"

    @classmethod
    def of(cls, pid: int) -> NetnsRef:
        return cls(pid, os.stat(f"/proc/{pid}/ns/net").st_ino)

    def to_json(self) -> dict[str, int]:
        return {"pid": self.pid, "ino": self.ino}


def _setns(fd: int, what: str) -> None:
    if _LIBC.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns({what}): {os.strerror(err)}")


def _listen_inside(netns: NetnsRef, port: int) -> socket.socket:
    """A socket listening on ``127.0.0.1:port`` inside ``netns``; call on a throwaway thread."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(netns.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(target).st_ino != netns.ino:
                raise OSError(f"{netns.path} is no longer the sandbox's network namespace")
            _setns(target, netns.path)
        finally:
            os.close(target)
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.bind(("127.0.0.1", port))
                listener.listen(64)
                listener.setblocking(False)
            except BaseException:
                listener.close()
                raise
        finally:
            _setns(home, "the worker's own namespace")
    finally:
        os.close(home)
    return listener


async def listen_inside(netns: NetnsRef, port: int) -> socket.socket:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[socket.socket] = loop.create_future()

    def work() -> None:
        try:
            result = _listen_inside(netns, port)
        except BaseException as exc:  # handed to the caller
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, result, None)

    threading.Thread(target=work, name="sandbox-netns", daemon=True).start()
    try:
        return await done
    except OSError as exc:
        raise SandboxError(f"could not open 127.0.0.1:{port} in the sandbox: {exc}") from exc


def _settle(
    future: asyncio.Future[socket.socket], value: socket.socket | None, error: BaseException | None
) -> None:
    if future.done():
        if value is not None:
            value.close()
        return
    if error is not None:
        future.set_exception(error)
    elif value is not None:
        future.set_result(value)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        writer.close()


async def forward(netns: NetnsRef, endpoint: Endpoint) -> Forwarder:
    """A started forwarder from ``127.0.0.1:endpoint.port`` inside ``netns`` to the target."""
    listener = await listen_inside(netns, endpoint.port)
    forwarder = Forwarder(endpoint)
    try:
        await forwarder.start(listener)
    except BaseException:
        listener.close()
        raise
    return forwarder


class Forwarder:
    """Relays connections accepted inside a sandbox to ``endpoint.target`` outside it."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self, listener: socket.socket) -> None:
        self._server = await asyncio.start_server(self._relay, sock=listener)

    async def _connect_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        unix = self.endpoint.unix_path
        if unix is not None:
            return await asyncio.open_unix_connection(unix)
        host, port = self.endpoint.host_port
        return await asyncio.open_connection(host, port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns.add(task)
        try:
            try:
                up_reader, up_writer = await self._connect_target()
            except OSError:
                return  # the sandbox sees a closed connection, as if the service were down
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            if task is not None:
                self._conns.discard(task)

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._conns):
            task.cancel()
        for task in list(self._conns):
            with contextlib.suppress(BaseException):
                await task
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)
