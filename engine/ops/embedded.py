"""An embedded Redis for the demo, the benches and the tests.

``start_redis()`` runs a real ``redis-server`` on a free loopback port when the binary
exists (persistence off, its own temp dir), else fakeredis's TCP server in a thread, so the
demo needs nothing beyond ``pip install``. Either way the caller gets a ``redis://`` URL
and a ``stop()`` that leaves no process or thread behind.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from engine.errors import LogUnavailable


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class EmbeddedRedis:
    kind: Literal["redis-server", "fakeredis"]
    port: int
    _proc: subprocess.Popen[bytes] | None = None
    _workdir: str | None = None
    _thread: threading.Thread | None = None
    _server: object | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
        if self._server is not None:
            server = self._server
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> EmbeddedRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis_server(binary: str = "redis-server", *, appendonly: bool = False) -> EmbeddedRedis:
    """A real redis-server on a free port; raises FileNotFoundError when not installed."""
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(binary)
    workdir = tempfile.mkdtemp(prefix="rollout-redis-")
    for _attempt in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if appendonly else "no", "--dir", workdir,
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port):
                return EmbeddedRedis("redis-server", port, _proc=proc, _workdir=workdir)
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)
    raise LogUnavailable(f"redis-server ({path}) did not start on a free port")


def start_fake_redis() -> EmbeddedRedis:
    """fakeredis's TCP server (Redis 7 semantics) in a background thread."""
    from fakeredis import TcpFakeServer

    port = free_port()
    server = TcpFakeServer(("127.0.0.1", port), server_version=(7, 0))
    thread = threading.Thread(target=server.serve_forever, name="fakeredis-tcp", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not _ping(port):
        if time.monotonic() > deadline:
            server.shutdown()
            raise LogUnavailable("fakeredis TCP server did not answer PING")
        time.sleep(0.02)
    return EmbeddedRedis("fakeredis", port, _thread=thread, _server=server)


def start_redis(*, prefer_real: bool = True) -> EmbeddedRedis:
    if prefer_real and shutil.which("redis-server"):
        return start_redis_server()
    return start_fake_redis()
