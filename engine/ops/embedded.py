"""An embedded Redis for the demo, the benches and the tests: authenticated by default.

``start_redis()`` runs a real ``redis-server`` on a free loopback port (persistence off)
when the binary exists, else fakeredis's TCP server in a thread; ``stop()`` leaves no
process or thread behind.

Security: a real server gets fresh passwords, never on a command line (SHA-256 hashes in a
``0600`` config in a ``0700`` folder), for ACL users ``default`` (the admin), ``engine``
(no ``@dangerous`` command, the stack's prefix only) and ``trainer`` (append to the control
stream, read the prefix). A URL carries its password: pass it in the environment, never
argv, which every local user can read. The fakeredis fallback authenticates nobody
(``authenticated`` is False): anyone who reaches its loopback port has full access.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.errors import ConfigError, LogUnavailable
from engine.events.names import StreamNames
from engine.events.redis_settings import redact

__all__ = [
    "EmbeddedRedis",
    "RedisTls",
    "free_port",
    "redact",
    "start_fake_redis",
    "start_redis",
    "start_redis_server",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True)
class RedisTls:
    """A TLS-only server's certificate and key, and the CA clients verify it with."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        context.check_hostname = False  # the certificate names the stack, not 127.0.0.1
        return context


def _command(*parts: bytes) -> bytes:
    out = b"*%d\r\n" % len(parts)
    for part in parts:
        out += b"$%d\r\n%s\r\n" % (len(part), part)
    return out


def _ping(port: int, password: str | None = None, tls: RedisTls | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            conn = raw if tls is None else tls.client_context().wrap_socket(raw)
            try:
                if password is not None:
                    conn.sendall(_command(b"AUTH", b"default", password.encode()))
                    if not conn.recv(64).startswith(b"+OK"):
                        return False
                conn.sendall(_command(b"PING"))
                return conn.recv(16).startswith(b"+PONG")
            finally:
                if conn is not raw:
                    conn.close()
    except (OSError, ssl.SSLError):
        return False


USERS = ("default", "engine", "trainer")


@dataclass
class EmbeddedRedis:
    kind: Literal["redis-server", "fakeredis"]
    port: int
    passwords: dict[str, str] = field(default_factory=dict, repr=False)
    prefix: str = "rl"
    tls: RedisTls | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _workdir: str | None = None
    _thread: threading.Thread | None = None
    _server: object | None = field(default=None, repr=False)

    @property
    def authenticated(self) -> bool:
        return bool(self.passwords)

    def url_for(self, user: str) -> str:
        """The URL of ``user`` (one of ``USERS``), password included."""
        scheme = "rediss" if self.tls is not None else "redis"
        if not self.passwords:
            return f"{scheme}://127.0.0.1:{self.port}/0"
        if user not in self.passwords:
            raise ConfigError(
                f"embedded redis has no user {user!r}; it has {sorted(self.passwords)}"
            )
        return f"{scheme}://{user}:{self.passwords[user]}@127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        """The admin's URL: for tests and tools, not for agents."""
        return self.url_for("default")

    @property
    def engine_url(self) -> str:
        return self.url_for("engine")

    @property
    def trainer_url(self) -> str:
        return self.url_for("trainer")

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


def _acl_rules(prefix: str) -> dict[str, str]:
    """Each user's ACL rules (after ``reset``: no keys, channels or commands)."""
    keys = f"~{prefix}:*"
    return {
        "default": "~* &* +@all",
        "engine": f"{keys} &* +@all -@dangerous",
        "trainer": (
            f"%R~{prefix}:* %W~{StreamNames(prefix).control} resetchannels -@all "
            "+xadd +xread +xrange +xrevrange +xlen +get +exists +type +scan "
            "+ping +hello +auth +select +client|setname +client|getname"
        ),
    }


def _write_config(
    workdir: str,
    port: int,
    prefix: str,
    passwords: dict[str, str],
    tls: RedisTls | None,
    appendonly: bool,
) -> str:
    lines = [
        "bind 127.0.0.1",
        'save ""',
        f"appendonly {'yes' if appendonly else 'no'}",
        f"dir {workdir}",
        "protected-mode yes",
    ]
    if tls is None:
        lines.append(f"port {port}")
    else:
        lines += [
            "port 0",
            f"tls-port {port}",
            f"tls-cert-file {tls.cert_file}",
            f"tls-key-file {tls.key_file}",
            f"tls-ca-cert-file {tls.ca_file}",
            "tls-auth-clients no",
        ]
    for user, rules in _acl_rules(prefix).items():
        digest = hashlib.sha256(passwords[user].encode()).hexdigest()
        lines.append(f"user {user} reset on #{digest} {rules}")
    path = os.path.join(workdir, "redis.conf")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return path


def start_redis_server(
    binary: str = "redis-server",
    *,
    appendonly: bool = False,
    prefix: str = "rl",
    tls: RedisTls | None = None,
) -> EmbeddedRedis:
    """A real redis-server on a free port with fresh ACL users; FileNotFoundError when
    not installed."""
    path = shutil.which(binary)
    if path is None:
        raise FileNotFoundError(binary)
    passwords = {user: secrets.token_urlsafe(24) for user in USERS}
    for _attempt in range(5):
        workdir = tempfile.mkdtemp(prefix="rollout-redis-")  # mode 0700
        port = free_port()
        config = _write_config(workdir, port, prefix, passwords, tls, appendonly)
        proc = subprocess.Popen(
            [path, config],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            if _ping(port, passwords["default"], tls):
                return EmbeddedRedis(
                    "redis-server", port, passwords, prefix, tls, _proc=proc, _workdir=workdir
                )
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    raise LogUnavailable(f"redis-server ({path}) did not start on a free port")


def start_fake_redis() -> EmbeddedRedis:
    """fakeredis's TCP server (Redis 7 semantics) in a background thread; no authentication."""
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
