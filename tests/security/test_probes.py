"""Attacks from inside a sandbox, as model-written code would try them: each probe is a test.

The setting is an evaluator worker's: this test process plays the worker (root, holding the
engine's Redis URL in its environment and a password file on disk); an authenticated
``redis-server`` and a tinylm server with an admin key run on loopback; every sample's
recording proxy is a tiny HTTP server the sample's sandbox reaches through ``expose``.

Every probe first runs from the worker's side (a positive control: the target is really
there and the probe really detects access), then from inside the sandbox, where it must be
blocked. A probe prints ``OPEN ...`` or ``BLOCKED <why>``.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.ops.embedded import EmbeddedRedis
from engine.sandbox import (
    MANAGED_LABEL,
    Endpoint,
    LocalSandbox,
    LocalSandboxConfig,
    LocalSandboxProvider,
)
from engine.sandbox.docker import DockerSandbox, DockerSandboxConfig, DockerSandboxProvider
from tests.sandbox.conftest import TEST_LIMITS, sandbox_python
from tinylm.server import TinyLMServer

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="the probes play a root evaluator worker on Linux",
)

PROBE = textwrap.dedent(
    """
    import os, socket, sys, urllib.request
    mode, *args = sys.argv[1:]
    try:
        if mode == "redis":  # a leaked password would not help: the connection never opens
            with socket.create_connection((args[0], int(args[1])), timeout=3) as conn:
                conn.sendall(("AUTH %s %s\\r\\nXADD rl:control * forged 1\\r\\n"
                              % (args[2], args[3])).encode())
                out = conn.recv(200)
        elif mode == "http":
            data = args[1].encode() if len(args) > 1 else None
            request = urllib.request.Request(args[0], data=data)
            out = urllib.request.urlopen(request, timeout=3).read()
        elif mode == "signal":
            os.kill(int(args[0]), 0)
            out = "may signal"
        elif mode == "read":
            out = open(args[0], "rb").read(200)
        elif mode == "list":
            out = os.listdir(args[0])
        elif mode == "write":
            with open(args[0], "w") as handle:
                handle.write("owned")
            out = "written"
        else:
            raise SystemExit("unknown probe " + mode)
        print("OPEN", out)
    except Exception as exc:
        print("BLOCKED", type(exc).__name__, exc)
    """
)


class _Proxy(http.server.BaseHTTPRequestHandler):
    """A sample's recording proxy: answers with whose proxy it is."""

    def do_GET(self) -> None:
        body = json.dumps({"proxy": self.server.owner}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def proxies() -> Iterator[dict[str, int]]:
    """One recording proxy per sample (``a``, ``b``), on the worker's loopback."""
    servers = {}
    for owner in ("a", "b"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
        server.owner = owner  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[owner] = server
    yield {owner: int(server.server_address[1]) for owner, server in servers.items()}
    for server in servers.values():
        server.shutdown()
        server.server_close()


@dataclass
class WorkerSecrets:
    pid: int
    """A process standing for the worker: root, the engine's Redis URL in its environment."""
    env_value: str
    password_file: Path
    private_dir: Path


@pytest.fixture
def worker_secrets(secured_redis: EmbeddedRedis) -> Iterator[WorkerSecrets]:
    """What a worker holds: the engine's URL in its environment, a 0600 password file in a
    folder the sandbox uid can traverse (so only the file's own mode protects it), and a 0700
    folder of its own."""
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={"PATH": os.environ.get("PATH", ""), "ROLLOUT_REDIS_URL": secured_redis.engine_url},
    )
    folder = Path(tempfile.mkdtemp(prefix="rollout-worker-", dir="/tmp"))
    folder.chmod(0o711)
    password_file = folder / "redis.password"
    password_file.write_text(secured_redis.passwords["engine"])
    password_file.chmod(0o600)
    private = folder / "private"
    private.mkdir(mode=0o700)
    yield WorkerSecrets(worker.pid, secured_redis.engine_url, password_file, private)
    worker.kill()
    worker.wait()
    shutil.rmtree(folder, ignore_errors=True)


def run_probe(*args: str) -> str:
    """The probe run by the worker itself: the positive control."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=30,
        check=False,
    )
    return done.stdout.strip()


# -- local sandboxes ---------------------------------------------------------------------


@pytest.fixture
def python() -> str:
    found = sandbox_python()
    if found is None:
        pytest.skip("no Python the sandbox uid can execute")
    return found


@pytest.fixture
async def provider(sandbox_root: Path) -> AsyncIterator[LocalSandboxProvider]:
    provider = LocalSandboxProvider(LocalSandboxConfig(root=sandbox_root, require_isolation=True))
    yield provider
    await provider.reap({MANAGED_LABEL: "1"})
    provider.close()


async def _local(provider: LocalSandboxProvider, sample: str) -> LocalSandbox:
    box = provider.create(labels={"rollout.sample": sample}, limits=TEST_LIMITS)
    await box.start()
    await box.write_file("probe.py", PROBE)
    return box


@pytest.fixture
async def box_a(provider: LocalSandboxProvider) -> AsyncIterator[LocalSandbox]:
    box = await _local(provider, "a")
    yield box
    await box.stop()


@pytest.fixture
async def box_b(provider: LocalSandboxProvider) -> AsyncIterator[LocalSandbox]:
    box = await _local(provider, "b")
    yield box
    await box.stop()


async def probe_in(box: LocalSandbox, python: str, *args: str) -> str:
    result = await box.exec([python, "probe.py", *args])
    assert result.exit_code == 0, result
    return result.stdout.strip()


async def test_local_sandbox_cannot_reach_redis(
    box_a: LocalSandbox, python: str, secured_redis: EmbeddedRedis
) -> None:
    args = ("redis", "127.0.0.1", str(secured_redis.port), "engine",
            secured_redis.passwords["engine"])
    assert run_probe(*args).startswith("OPEN b'+OK")  # the worker can, with the password
    assert (await probe_in(box_a, python, *args)).startswith("BLOCKED ConnectionRefusedError")


async def test_local_sandbox_cannot_reach_the_model_servers_admin_routes(
    box_a: LocalSandbox, python: str, model_server: TinyLMServer
) -> None:
    abort = ("http", model_server.url + "/abort_request", '{"abort_all": true}')
    assert run_probe("http", model_server.url + "/health").startswith("OPEN")
    assert (await probe_in(box_a, python, *abort)).startswith("BLOCKED URLError")


async def test_the_model_server_an_episode_may_reach_still_refuses_admin_calls(
    box_a: LocalSandbox, python: str, model_server: TinyLMServer
) -> None:
    """A task that lets its code query the policy exposes the model server; inference is
    open, the admin routes answer 401 to anyone without the admin key."""
    await box_a.expose(Endpoint(port=30000, target=model_server.url.removeprefix("http://")))
    models = await probe_in(box_a, python, "http", "http://127.0.0.1:30000/v1/models")
    assert models.startswith("OPEN"), models
    for route in ("/abort_request", "/pause_generation", "/update_weights_from_disk",
                  "/flush_cache"):
        reply = await probe_in(box_a, python, "http", "http://127.0.0.1:30000" + route, "{}")
        assert reply.startswith("BLOCKED HTTPError HTTP Error 401"), (route, reply)


async def test_local_sandbox_reaches_its_own_proxy_and_not_another_samples(
    box_a: LocalSandbox, box_b: LocalSandbox, python: str, proxies: dict[str, int]
) -> None:
    await box_a.expose(Endpoint(port=8080, target=f"127.0.0.1:{proxies['a']}"))
    await box_b.expose(Endpoint(port=8080, target=f"127.0.0.1:{proxies['b']}"))
    own = await probe_in(box_b, python, "http", "http://127.0.0.1:8080/")
    assert own == "OPEN " + repr(b'{"proxy": "b"}')
    assert run_probe("http", f"http://127.0.0.1:{proxies['a']}/").startswith("OPEN")
    other = await probe_in(box_b, python, "http", f"http://127.0.0.1:{proxies['a']}/")
    assert other.startswith("BLOCKED URLError"), other
    # A's sandbox-side listener lives in A's namespace: B's port 8080 is B's own proxy.
    assert own != await probe_in(box_a, python, "http", "http://127.0.0.1:8080/")


async def test_local_sandbox_cannot_signal_the_worker_or_its_supervisor(
    box_a: LocalSandbox, python: str, provider: LocalSandboxProvider,
    worker_secrets: WorkerSecrets,
) -> None:
    worker = str(worker_secrets.pid)
    assert run_probe("signal", worker) == "OPEN may signal"
    assert (await probe_in(box_a, python, "signal", worker)).startswith(
        "BLOCKED PermissionError"
    )
    supervisor = provider.supervisor_pid
    assert supervisor is not None
    assert (await probe_in(box_a, python, "signal", str(supervisor))).startswith(
        "BLOCKED PermissionError"
    )


async def test_local_sandbox_cannot_read_the_workers_environment(
    box_a: LocalSandbox, python: str, worker_secrets: WorkerSecrets
) -> None:
    environ = f"/proc/{worker_secrets.pid}/environ"
    assert worker_secrets.env_value.encode() in Path(environ).read_bytes()  # it is there
    assert (await probe_in(box_a, python, "read", environ)).startswith("BLOCKED PermissionError")
    own_env = await box_a.exec(["env"])
    assert "ROLLOUT_REDIS" not in own_env.stdout
    assert worker_secrets.env_value not in own_env.stdout


async def test_local_sandbox_cannot_read_or_write_the_workers_files(
    box_a: LocalSandbox, python: str, worker_secrets: WorkerSecrets
) -> None:
    secret = str(worker_secrets.password_file)
    assert run_probe("read", secret).startswith("OPEN")
    assert (await probe_in(box_a, python, "read", secret)).startswith("BLOCKED PermissionError")
    planted = str(worker_secrets.private_dir / "planted")
    assert (await probe_in(box_a, python, "write", planted)).startswith("BLOCKED PermissionError")
    assert not Path(planted).exists()


async def test_local_sandbox_cannot_touch_another_sandboxs_folder(
    box_a: LocalSandbox, box_b: LocalSandbox, python: str
) -> None:
    await box_a.write_file("answer.txt", "A's work")
    target = f"{box_a.workdir}/answer.txt"
    for args in (("read", target), ("list", box_a.workdir),
                 ("write", f"{box_a.workdir}/planted"), ("read", str(box_a.path / "sandbox.json"))):
        reply = await probe_in(box_b, python, *args)
        assert reply.startswith("BLOCKED PermissionError"), (args, reply)
    assert (await probe_in(box_a, python, "read", target)).startswith("OPEN")


# -- Docker sandboxes -------------------------------------------------------------------


@pytest.fixture
async def docker_provider(docker_image: str) -> AsyncIterator[DockerSandboxProvider]:
    provider = DockerSandboxProvider(DockerSandboxConfig(image=docker_image))
    yield provider
    await provider.reap({"rollout.test": "security-probes"})
    provider.close()


async def _container(provider: DockerSandboxProvider) -> DockerSandbox:
    box = provider.create(labels={"rollout.test": "security-probes"}, limits=TEST_LIMITS)
    await box.start()
    return box


async def shell_probe(box: DockerSandbox, command: str) -> str:
    result = await box.exec(f"if {command} >/dev/null 2>&1; then echo OPEN; else echo BLOCKED; fi")
    return result.stdout.strip()


@pytest.mark.docker
async def test_docker_sandbox_cannot_reach_redis_the_model_server_or_a_proxy(
    docker_provider: DockerSandboxProvider,
    docker_image: str,
    secured_redis: EmbeddedRedis,
    model_server: TinyLMServer,
    proxies: dict[str, int],
) -> None:
    probes = {
        "redis": f"echo PING | nc -w 3 127.0.0.1 {secured_redis.port} | grep -q NOAUTH",
        "the model server": f"timeout 5 wget -qO- http://127.0.0.1:{model_server.port}/health",
        "another sample's proxy": f"timeout 5 wget -qO- http://127.0.0.1:{proxies['a']}/",
    }
    # Positive control: the same probes from a container that shares the host's network.
    shared = DockerSandboxProvider(DockerSandboxConfig(image=docker_image, network_mode="host"))
    control = await _container(shared)
    try:
        for name, command in probes.items():
            assert await shell_probe(control, command) == "OPEN", name
    finally:
        await control.stop()
        shared.close()
    box = await _container(docker_provider)
    try:
        for name, command in probes.items():
            assert await shell_probe(box, command) == "BLOCKED", name
    finally:
        await box.stop()


@pytest.mark.docker
async def test_docker_sandbox_reaches_its_own_proxy_only(
    docker_provider: DockerSandboxProvider, proxies: dict[str, int]
) -> None:
    a, b = await _container(docker_provider), await _container(docker_provider)
    try:
        await a.expose(Endpoint(port=8080, target=f"127.0.0.1:{proxies['a']}"))
        reply = await a.exec("timeout 5 wget -qO- http://127.0.0.1:8080/")
        assert json.loads(reply.stdout) == {"proxy": "a"}, reply
        assert await shell_probe(b, "timeout 5 wget -qO- http://127.0.0.1:8080/") == "BLOCKED"
    finally:
        await a.stop()
        await b.stop()


@pytest.mark.docker
async def test_docker_sandbox_cannot_see_the_worker_or_other_sandboxes(
    docker_provider: DockerSandboxProvider, worker_secrets: WorkerSecrets
) -> None:
    a, b = await _container(docker_provider), await _container(docker_provider)
    try:
        await a.write_file("answer.txt", "A's work")
        probes = {
            "signal the worker": f"kill -0 {worker_secrets.pid}",
            "the worker's environment": f"cat /proc/{worker_secrets.pid}/environ",
            "the worker's password file": f"cat {worker_secrets.password_file}",
            "another sandbox's work": f"cat {a.workdir}/answer.txt",
        }
        assert await shell_probe(a, f"cat {a.workdir}/answer.txt") == "OPEN"
        for name, command in probes.items():
            assert await shell_probe(b, command) == "BLOCKED", name
        env = await b.exec("env")
        assert "ROLLOUT_REDIS" not in env.stdout and worker_secrets.env_value not in env.stdout
    finally:
        await a.stop()
        await b.stop()


def test_probe_script_reports_open_for_reachable_targets() -> None:
    """The probe itself can see access (guards every BLOCKED assertion above)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as handle:
        handle.write("x")
        handle.flush()
        assert run_probe("read", handle.name) == "OPEN b'x'"
    assert run_probe("read", "/nonexistent/file").startswith("BLOCKED FileNotFoundError")
