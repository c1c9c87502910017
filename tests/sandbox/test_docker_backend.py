"""Docker-only behaviour: the container's limits, its user, and errors from the daemon."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from engine.errors import SandboxError
from engine.sandbox import KillReason, SandboxLimits
from engine.sandbox.docker import DockerSandbox, DockerSandboxConfig, DockerSandboxProvider
from tests.sandbox.conftest import TEST_LIMITS

pytestmark = pytest.mark.docker

SMALL = dataclasses.replace(TEST_LIMITS, memory_mb=64, max_procs=32, cpu_time_s=1)


@pytest.fixture
async def provider(docker_image: str) -> AsyncIterator[DockerSandboxProvider]:
    provider = DockerSandboxProvider(DockerSandboxConfig(image=docker_image))
    yield provider
    await provider.reap({"rollout.test": "docker-backend"})
    provider.close()


async def started(provider: DockerSandboxProvider, limits: SandboxLimits = SMALL) -> DockerSandbox:
    box = provider.create(labels={"rollout.test": "docker-backend"}, limits=limits)
    await box.start()
    return box


async def test_limits_are_classified(provider: DockerSandboxProvider) -> None:
    box = await started(provider)
    try:
        cpu = await box.exec("while :; do :; done", timeout_s=30)
        assert cpu.killed_by == KillReason.CPU and cpu.exit_code == 152, cpu
        oom = await box.exec("dd if=/dev/zero of=/dev/null bs=200M count=1")
        assert oom.killed_by == KillReason.MEMORY and oom.exit_code == 137, oom
        killed = await box.exec("kill -9 $$")
        assert killed.killed_by == "SIGKILL", killed  # a kill that was not the OOM killer
        bomb = await box.exec("f() { f | f; }; f", timeout_s=10)
        assert bomb.killed_by == KillReason.PIDS, bomb
        assert (await box.exec("echo usable")).stdout == "usable\n"
    finally:
        await box.stop()


async def test_disk_limit_is_a_sized_workdir(provider: DockerSandboxProvider) -> None:
    box = await started(provider, dataclasses.replace(SMALL, disk_mb=1))
    try:
        full = await box.exec("dd if=/dev/zero of=big bs=1M count=5")
        assert full.killed_by == KillReason.DISK and full.exit_code != 0, full
    finally:
        await box.stop()


async def test_runs_as_the_configured_user(docker_image: str) -> None:
    provider = DockerSandboxProvider(DockerSandboxConfig(image=docker_image, user="1000:1000"))
    box = provider.create(labels={"rollout.test": "docker-backend"}, limits=SMALL)
    await box.start()
    try:
        assert (await box.exec("id -u")).stdout == "1000\n"
        await box.write_file("sub/owned.txt", "x")
        owners = await box.exec("stat -c %u sub sub/owned.txt")
        assert owners.stdout.split() == ["1000", "1000"]
        assert (await box.exec("echo more >> sub/owned.txt && cat sub/owned.txt")).exit_code == 0
        timed = await box.exec("sleep 999 & echo $! > p; wait", timeout_s=1)
        assert timed.timed_out
        gone = await box.exec(
            'sleep 0.2; kill -0 "$(cat p)" 2>/dev/null && echo alive || echo gone'
        )
        assert gone.stdout == "gone\n"
    finally:
        await box.stop()
        provider.close()


async def test_missing_image_is_a_sandbox_error(docker_image: str) -> None:
    provider = DockerSandboxProvider(DockerSandboxConfig(image="rollout-no-such-image:never"))
    box = provider.create(labels={"rollout.test": "docker-backend"})
    with pytest.raises(SandboxError, match="rollout-no-such-image"):
        await box.start()
    with pytest.raises(SandboxError, match="rollout-no-such-image"):
        await provider.ping()
    provider.close()


async def test_unreachable_daemon_is_a_sandbox_error() -> None:
    provider = DockerSandboxProvider(
        DockerSandboxConfig(image="x", base_url="unix:///nonexistent/docker.sock")
    )
    with pytest.raises(SandboxError, match="docker"):
        await provider.ping()
    with pytest.raises(SandboxError, match="docker"):
        await provider.reap({"rollout.worker": "w"})
