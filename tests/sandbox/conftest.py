"""Fixtures for the sandbox tests: one provider per backend, scoped labels, cleanup checks.

The Docker backend runs when a daemon answers and a static busybox is at hand to build the test
image (see ``docker_image.py``); otherwise its tests are skipped with the reason, or fail when
``TEST_REQUIRE_DOCKER=require`` (set it in CI once CI starts a dockerd).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.sandbox import MANAGED_LABEL, LocalSandboxConfig, LocalSandboxProvider, SandboxLimits
from engine.sandbox.base import Sandbox, SandboxProvider
from engine.sandbox.docker import DockerSandboxConfig, DockerSandboxProvider
from tests.sandbox.docker_image import ensure_image, find_static_busybox

DOCKER_REQUIRED_ENV = "TEST_REQUIRE_DOCKER"

TEST_LIMITS = SandboxLimits(
    cpu_time_s=20,
    memory_mb=256,
    max_procs=64,
    wall_timeout_s=20,
    max_output_bytes=4096,
)


@dataclass
class Backend:
    name: str
    provider: Any  # LocalSandboxProvider | DockerSandboxProvider
    run_labels: dict[str, str]
    """Labels that scope everything a test creates (reaped after the test)."""

    def labels(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {**self.run_labels, **(extra or {})}

    def create(
        self, labels: Mapping[str, str] | None = None, limits: SandboxLimits = TEST_LIMITS
    ) -> Sandbox:
        sandbox: Sandbox = self.provider.create(labels=self.labels(labels), limits=limits)
        return sandbox


@pytest.fixture(scope="session")
def docker_image() -> Iterator[str]:
    reason = ""
    tag = ""
    client = None
    try:
        import docker

        client = docker.from_env(timeout=20)
        client.ping()
    except Exception as exc:
        reason = f"no reachable dockerd: {exc}"
    else:
        busybox = find_static_busybox()
        if busybox is None:
            reason = "no static busybox to build the test image (apt-get install busybox-static)"
        else:
            tag = ensure_image(client, busybox)
    if reason:
        if os.environ.get(DOCKER_REQUIRED_ENV, "").lower() == "require":
            pytest.fail(f"{DOCKER_REQUIRED_ENV}=require but {reason}")
        pytest.skip(reason)
    yield tag
    if client is not None:
        client.close()


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    """A fresh sandbox root the sandbox uids can traverse (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="rollout-sandbox-tests-", dir=tempfile.gettempdir()))
    root.chmod(0o711)
    yield root
    # A failed test may have left sandboxes running: reap them (processes, cgroups, uids)
    # before the folder that records them goes.
    janitor = LocalSandboxProvider(LocalSandboxConfig(root=root))
    asyncio.run(janitor.reap({MANAGED_LABEL: "1"}))
    janitor.close()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def local_provider(sandbox_root: Path) -> Iterator[LocalSandboxProvider]:
    provider = LocalSandboxProvider(LocalSandboxConfig(root=sandbox_root))
    yield provider
    provider.close()


def _run_labels() -> dict[str, str]:
    return {"rollout.test-run": uuid.uuid4().hex[:12]}


@pytest.fixture(params=["local", pytest.param("docker", marks=pytest.mark.docker)])
async def backend(request: pytest.FixtureRequest, sandbox_root: Path) -> AsyncIterator[Backend]:
    provider: SandboxProvider
    if request.param == "local":
        provider = LocalSandboxProvider(LocalSandboxConfig(root=sandbox_root))
    else:
        image = request.getfixturevalue("docker_image")
        provider = DockerSandboxProvider(DockerSandboxConfig(image=image))
    backend = Backend(request.param, provider, _run_labels())
    yield backend
    leftovers = await provider.reap(backend.run_labels)
    if isinstance(provider, LocalSandboxProvider | DockerSandboxProvider):
        provider.close()
    assert leftovers >= 0


@pytest.fixture
async def sandbox(backend: Backend) -> AsyncIterator[Sandbox]:
    box = backend.create()
    await box.start()
    yield box
    await box.stop()


def sandbox_python() -> str | None:
    """A Python the sandbox's uid can execute (a root worker's own may sit under /root)."""
    candidates = ["/usr/bin/python3", "/usr/local/bin/python3", sys.executable]
    for candidate in candidates:
        path = Path(candidate)
        if not path.exists():
            continue
        if os.geteuid() != 0:
            return candidate
        resolved = path.resolve()
        chain = [resolved, *resolved.parents]
        if all(part.stat().st_mode & stat.S_IXOTH for part in chain):
            return str(resolved)
    return None
