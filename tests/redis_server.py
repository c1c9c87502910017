"""Start a real ``redis-server`` on a free loopback port for the integration tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RedisServer:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: str

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_redis_server(binary: str = "redis-server") -> RedisServer:
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(binary)
    workdir = tempfile.mkdtemp(prefix="rollout-redis-")
    for _attempt in range(5):
        port = free_port()
        proc = subprocess.Popen(
            [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir, "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return RedisServer(proc, port, workdir)
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait()
    raise RuntimeError(f"redis-server did not start (see {workdir})")


def redis_required() -> bool:
    """In CI a missing redis-server is a failure, not a skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
