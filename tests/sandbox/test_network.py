"""Network containment: a namespace per local sandbox, ``network_mode=none`` under Docker, and
the one endpoint a sandbox may be given (``Sandbox.expose``), tested with a tiny HTTP server.

A refusal is real, not simulated: the worker runs with ``CAP_SYS_ADMIN`` dropped from its
bounding set (as in an unprivileged container), so the kernel refuses ``unshare(CLONE_NEWNET)``.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.errors import ConfigError, SandboxError
from engine.sandbox import (
    Endpoint,
    LocalSandbox,
    LocalSandboxConfig,
    LocalSandboxProvider,
    _procs,
)
from engine.sandbox.docker import DockerSandboxConfig, DockerSandboxProvider
from tests.sandbox.conftest import TEST_LIMITS, sandbox_python

ROOT_ONLY = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0,
    reason="network namespaces need a root worker on Linux",
)
REPO = Path(__file__).resolve().parents[2]


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"path": self.path, "server": self.server.name}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve_http(name: str, host: str = "127.0.0.1") -> tuple[http.server.HTTPServer, int]:
    server = http.server.ThreadingHTTPServer((host, 0), _Hello)
    server.name = name  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


@pytest.fixture
def http_server() -> Iterator[int]:
    server, port = serve_http("host")
    yield port
    server.shutdown()
    server.server_close()


@pytest.fixture
def python() -> str:
    found = sandbox_python()
    if found is None:
        pytest.skip("no Python the sandbox uid can execute")
    return found


def fetch(python: str, url: str) -> list[str]:
    """argv of a command that prints the body at ``url`` or ``BLOCKED <error>``."""
    code = textwrap.dedent(
        f"""
        import urllib.request
        try:
            print(urllib.request.urlopen({url!r}, timeout=5).read().decode())
        except Exception as exc:
            print("BLOCKED", type(exc).__name__, exc)
        """
    )
    return [python, "-c", code]


@pytest.fixture
async def box(local_provider: LocalSandboxProvider) -> AsyncIterator[LocalSandbox]:
    sandbox = local_provider.create(labels={"rollout.test": "network"}, limits=TEST_LIMITS)
    await sandbox.start()
    yield sandbox
    await sandbox.stop()


@ROOT_ONLY
async def test_a_local_sandbox_has_only_its_own_loopback(
    local_provider: LocalSandboxProvider, box: LocalSandbox, python: str, http_server: int
) -> None:
    assert local_provider.containment.network, local_provider.containment.describe()
    assert "network namespace per sandbox" in local_provider.containment.describe()
    assert box.network_namespace is not None
    assert os.stat(box.network_namespace).st_ino != os.stat("/proc/self/ns/net").st_ino
    interfaces = await box.exec(["cat", "/proc/net/dev"])
    names = {line.split(":")[0].strip() for line in interfaces.stdout.splitlines()[2:]}
    assert names == {"lo"}
    routes = await box.exec(["cat", "/proc/net/route"])
    assert routes.stdout.splitlines()[1:] == []  # no route out, not even a default one
    reached = await box.exec(fetch(python, f"http://127.0.0.1:{http_server}/"))
    assert reached.stdout.startswith("BLOCKED"), reached


@ROOT_ONLY
async def test_commands_of_one_sandbox_share_its_loopback_and_sandboxes_do_not(
    local_provider: LocalSandboxProvider, box: LocalSandbox, python: str
) -> None:
    port = 18765
    server = [python, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    started = await box.exec(" ".join(server) + " >/dev/null 2>&1 &")
    assert started.exit_code == 0
    probe = fetch(python, f"http://127.0.0.1:{port}/")
    answered = await box.exec(
        ["/bin/sh", "-c", 'for i in $(seq 100); do "$@" | grep -qv BLOCKED && exit 0; '
         "sleep 0.1; done; exit 1", "sh", *probe]
    )
    assert answered.exit_code == 0, answered
    other = local_provider.create(labels={"rollout.test": "network"}, limits=TEST_LIMITS)
    await other.start()
    try:
        assert other.network_namespace != box.network_namespace
        reached = await other.exec(probe)
        assert reached.stdout.startswith("BLOCKED"), reached
    finally:
        await other.stop()


@ROOT_ONLY
async def test_the_namespace_holder_is_root_and_goes_with_the_sandbox(
    local_provider: LocalSandboxProvider,
) -> None:
    sandbox = local_provider.create(labels={"rollout.test": "network"}, limits=TEST_LIMITS)
    await sandbox.start()
    holder = sandbox.network_holder_pid
    assert holder is not None
    info = _procs.proc_info(holder)
    assert info is not None and info.uids[0] == 0  # the sandbox uid cannot signal it
    killed = await sandbox.exec(["kill", "-9", str(holder)])
    assert killed.exit_code != 0 and "ermitted" in killed.stderr, killed
    await sandbox.stop()
    gone = _procs.proc_info(holder)
    assert gone is None or gone.state in ("Z", "X")


@ROOT_ONLY
async def test_expose_gives_exactly_one_endpoint_inside(
    box: LocalSandbox, python: str, http_server: int
) -> None:
    other_server, other_port = serve_http("not-exposed")
    try:
        address = await box.expose(Endpoint(port=8080, target=f"127.0.0.1:{http_server}"))
        assert address == "127.0.0.1:8080"
        reached = await box.exec(fetch(python, "http://127.0.0.1:8080/v1/models"))
        assert json.loads(reached.stdout) == {"path": "/v1/models", "server": "host"}, reached
        # The target's port inside the sandbox, and any other host service, stay unreachable.
        for port in (http_server, other_port):
            blocked = await box.exec(fetch(python, f"http://127.0.0.1:{port}/"))
            assert blocked.stdout.startswith("BLOCKED"), blocked
    finally:
        other_server.shutdown()
        other_server.server_close()


@ROOT_ONLY
async def test_expose_forwards_to_a_unix_socket(
    box: LocalSandbox, python: str, tmp_path: Path
) -> None:
    path = tmp_path / "proxy.sock"

    class UnixHTTP(http.server.ThreadingHTTPServer):
        address_family = socket.AF_UNIX

        def server_bind(self) -> None:
            self.socket.bind(self.server_address)
            self.server_name, self.server_port = "unix", 0

    server = UnixHTTP(str(path), _Hello)  # type: ignore[arg-type]
    server.name = "unix"  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        await box.expose(Endpoint(port=9000, target=f"unix:{path}"))
        reached = await box.exec(fetch(python, "http://127.0.0.1:9000/record"))
        assert json.loads(reached.stdout) == {"path": "/record", "server": "unix"}, reached
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_targets_are_validated() -> None:
    with pytest.raises(ConfigError, match="HOST:PORT"):
        Endpoint(port=80, target="localhost")
    with pytest.raises(ConfigError, match="absolute"):
        Endpoint(port=80, target="unix:relative.sock")
    with pytest.raises(ConfigError, match="1..65535"):
        Endpoint(port=0, target="127.0.0.1:80")


async def test_network_off_shares_the_host_and_has_nothing_to_expose(
    sandbox_root: Path, http_server: int
) -> None:
    provider = LocalSandboxProvider(LocalSandboxConfig(root=sandbox_root, network="off"))
    try:
        assert not provider.containment.network
        assert "HOST'S NETWORK" in provider.containment.describe()
        sandbox = provider.create(labels={"rollout.test": "network"}, limits=TEST_LIMITS)
        await sandbox.start()
        try:
            assert sandbox.network_namespace is None
            with pytest.raises(SandboxError, match="no network namespace of its own"):
                await sandbox.expose(Endpoint(port=8080, target=f"127.0.0.1:{http_server}"))
        finally:
            await sandbox.stop()
    finally:
        provider.close()


def _drop_sys_admin() -> None:
    """In the child before exec: no CAP_SYS_ADMIN for it or anything it starts."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 21, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_ADMIN
        raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")


_UNPRIVILEGED = """
import logging, sys
from pathlib import Path
from engine.errors import ConfigError
from workers.evaluator import _sandbox_provider
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
try:
    provider = _sandbox_provider("local", Path(sys.argv[1]), require_isolation=sys.argv[2] == "1")
except ConfigError as exc:
    print("REFUSED", exc)
    sys.exit(2)
print("NETWORK", provider.containment.network)
"""


def _unprivileged(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=60, check=False, preexec_fn=_drop_sys_admin,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
    )


@ROOT_ONLY
def test_where_the_machine_refuses_the_worker_says_so_loudly_or_refuses_to_start(
    sandbox_root: Path,
) -> None:
    warned = _unprivileged(_UNPRIVILEGED, str(sandbox_root), "0")
    assert warned.returncode == 0, warned.stderr
    assert "NETWORK False" in warned.stdout
    assert "WARNING SANDBOXES ARE NOT ISOLATED" in warned.stderr
    assert "unshare(CLONE_NEWNET) refused: Operation not permitted" in warned.stderr
    refused = _unprivileged(_UNPRIVILEGED, str(sandbox_root), "1")
    assert refused.returncode == 2, refused
    assert "REFUSED sandbox isolation is required" in refused.stdout


@ROOT_ONLY
def test_network_required_is_a_config_error_where_refused(sandbox_root: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.errors import ConfigError\n"
        "from engine.sandbox import LocalSandboxConfig, LocalSandboxProvider\n"
        "try:\n"
        "    LocalSandboxProvider(LocalSandboxConfig(root=Path(sys.argv[1]), network='required'))\n"
        "except ConfigError as exc:\n"
        "    print('REFUSED', exc)\n"
    )
    done = _unprivileged(code, str(sandbox_root))
    expected = "REFUSED LocalSandboxConfig.network='required' but unshare(CLONE_NEWNET) refused"
    assert expected in done.stdout, done


@pytest.mark.docker
async def test_docker_sandboxes_have_no_network_and_one_exposed_endpoint(
    docker_image: str, http_server: int
) -> None:
    provider = DockerSandboxProvider(DockerSandboxConfig(image=docker_image))
    sandbox = provider.create(labels={"rollout.test": "network"}, limits=TEST_LIMITS)
    await sandbox.start()
    try:
        assert sandbox._container.attrs["HostConfig"]["NetworkMode"] == "none"
        interfaces = await sandbox.exec(["cat", "/proc/net/dev"])
        names = {line.split(":")[0].strip() for line in interfaces.stdout.splitlines()[2:]}
        assert names == {"lo"}
        if os.geteuid() != 0:
            return
        await sandbox.expose(Endpoint(port=8080, target=f"127.0.0.1:{http_server}"))
        reached = await sandbox.exec("wget -qO- http://127.0.0.1:8080/inside")
        assert json.loads(reached.stdout) == {"path": "/inside", "server": "host"}, reached
        blocked = await sandbox.exec(f"wget -qO- -T 3 http://127.0.0.1:{http_server}/")
        assert blocked.exit_code != 0
    finally:
        await sandbox.stop()
        await provider.reap({"rollout.test": "network"})
        provider.close()
