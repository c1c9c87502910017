"""A real 3-master Redis Cluster for the tests, started from the redis-server binary.

Three ``redis-server --cluster-enabled yes`` processes on free ports, joined with
``redis-cli --cluster create ... --cluster-yes`` (no replicas). ``cluster_fixture`` skips
when either binary is missing, and fails instead under ``CI=true`` (like the single
redis-server fixture). ``RedisCluster.url`` is a ``redis+cluster://`` URL naming one node.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.redis_server import redis_required

__all__ = ["RedisClusterProcs", "cluster_fixture", "start_cluster"]

MASTERS = 3


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_ports(n: int) -> list[int]:
    """``n`` ports whose cluster-bus port (+10000) is free too."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 55535 and port not in found and _free(port + 10000):
            found.append(port)
    return found


@dataclass
class RedisClusterProcs:
    ports: list[int]
    workdir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def cli(self, port: int, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), *args],
            check=True, capture_output=True, timeout=30,
        )
        return out.stdout.decode()

    def flushall(self) -> None:
        for port in self.ports:
            self.cli(port, "FLUSHALL")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_cluster() -> RedisClusterProcs:
    workdir = Path(tempfile.mkdtemp(prefix="redis-cluster-"))
    cluster = RedisClusterProcs(_free_ports(MASTERS), workdir)
    try:
        for port in cluster.ports:
            node_dir = workdir / str(port)
            node_dir.mkdir()
            cluster.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", "5000", "--dir", str(node_dir),
                 "--save", "", "--appendonly", "no", "--protected-mode", "yes"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        for port in cluster.ports:
            _wait(lambda p=port: cluster.cli(p, "PING").strip() == "PONG", f"node {port}")
        subprocess.run(
            ["redis-cli", "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in cluster.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        for port in cluster.ports:
            _wait(lambda p=port: "cluster_state:ok" in cluster.cli(p, "CLUSTER", "INFO"),
                  f"cluster state on {port}")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait(check: object, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except subprocess.CalledProcessError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"redis cluster: {what} not ready after {timeout_s:g} s")


def cluster_fixture() -> Iterator[RedisClusterProcs]:
    """Body of a fixture yielding a running cluster (skip or, in CI, fail without binaries)."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        if redis_required():
            pytest.fail(f"{' and '.join(missing)} missing in CI: .ci/run must install them")
        pytest.skip(f"{' and '.join(missing)} not installed")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()
