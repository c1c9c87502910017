"""The model server binds loopback and keeps its admin routes for the admin key's holder.

The rules are SGLang's (sglang 0.5.23, ``sglang/srt/utils/auth.py`` ``decide_request_auth``,
levels set per route in ``sglang/srt/entrypoints/http_server.py``): health routes always open;
admin routes need the admin key when one is set (the API key no longer opens them), else the
API key, else nothing; other routes need the API key when one is set.
"""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.security.conftest import ADMIN_KEY
from tinylm.auth import allowed
from tinylm.process import spawn_server
from tinylm.server import ServerConfig, TinyLMServer, start_server


def call(url: str, *, key: str | None = None, body: object | None = None) -> int:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if data is None else "POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.parametrize(
    ("path", "header", "api_key", "admin_key", "expected"),
    [
        ("/health", None, "k", "a", True),  # probes need no secret
        ("/generate", None, None, "a", True),  # an admin key alone leaves inference open
        ("/generate", None, "k", None, False),
        ("/generate", "Bearer k", "k", None, True),
        ("/generate", "Bearer a", "k", "a", False),  # the admin key is not the API key
        ("/abort_request", None, None, None, True),  # no keys: as before
        ("/abort_request", None, None, "a", False),
        ("/abort_request", "Bearer k", "k", "a", False),  # API key cannot reach admin routes
        ("/abort_request", "Bearer a", "k", "a", True),
        ("/abort_request", "Bearer k", "k", None, True),  # only an API key: it opens all
        ("/update_weights_from_disk", "Basic a", None, "a", False),
        ("/pause_generation/", "bearer a", None, "a", True),
    ],
)
def test_the_decision_follows_sglang(
    path: str, header: str | None, api_key: str | None, admin_key: str | None, expected: bool
) -> None:
    assert allowed("POST", path, header, api_key=api_key, admin_api_key=admin_key) is expected


def test_admin_routes_need_the_admin_key(model_server: TinyLMServer) -> None:
    url = model_server.url
    for route in ("/abort_request", "/pause_generation", "/continue_generation", "/flush_cache",
                  "/update_weights_from_disk"):
        assert call(url + route, body={"abort_all": True}) == 401, route
        assert call(url + route, key="guess", body={"abort_all": True}) == 401, route
    assert call(url + "/abort_request", key=ADMIN_KEY, body={"abort_all": True}) == 200
    assert call(url + "/health") == 200
    assert call(url + "/v1/models") == 200  # inference stays open to the workers


def test_servers_bind_loopback_unless_told_otherwise(model_dir: Path) -> None:
    assert ServerConfig(model_dir=model_dir).host == "127.0.0.1"
    with start_server(model_dir, max_running_requests=1) as server:
        assert server.address[0] == "127.0.0.1"
        other = _an_address_of_this_host()
        if other is not None:
            with pytest.raises(OSError):
                socket.create_connection((other, server.port), timeout=2).close()


def _an_address_of_this_host() -> str | None:
    """A non-loopback address of this machine (the default route's source), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def test_the_cli_reads_the_admin_key_from_a_file_not_argv(model_dir: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text(ADMIN_KEY + "\n")
    key_file.chmod(0o600)
    with spawn_server(model_dir, extra_args=["--admin-api-key-file", str(key_file)]) as proc:
        cmdline = Path(f"/proc/{proc.process.pid}/cmdline").read_bytes()
        assert ADMIN_KEY.encode() not in cmdline
        assert call(proc.url + "/abort_request", body={"abort_all": True}) == 401
        assert call(proc.url + "/abort_request", key=ADMIN_KEY, body={"abort_all": True}) == 200
    assert os.path.exists(key_file)
