"""Worker processes with ``--sandbox docker`` on a real redis-server and a real dockerd.

The image is the locally imported busybox one of ``tests/sandbox/docker_image.py``; without a
daemon these tests are skipped, or fail under ``TEST_REQUIRE_DOCKER=require``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.client import RolloutClient
from engine.events import EventLog
from engine.ops.processes import Processes
from engine.sandbox import MANAGED_LABEL
from tests.actors.fixtures.docker_evaluators import RUN_CPU, RUN_MEMORY_GB
from tests.rig import start_finalizer, start_rollout
from tests.sandbox.conftest import docker_image  # noqa: F401 - the session fixture

pytestmark = [pytest.mark.slow, pytest.mark.redis_server, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "tests" / "actors" / "fixtures" / "docker_evaluators.py"


@pytest.fixture
def docker_client(docker_image: str) -> Iterator[Any]:  # noqa: F811 - the imported fixture
    import docker

    client = docker.from_env(timeout=20)
    yield client
    client.close()


def docker_worker(procs: Processes, worker_id: str, image: str) -> None:
    """An evaluator worker whose sandboxes are containers of ``image``."""
    procs.start(worker_id, "worker", settings={
        "worker_id": worker_id, "evaluator_config": CONFIG, "sandbox": "docker",
        "docker_image": image})


def _containers(client: Any, **labels: str) -> list[Any]:
    filters = {"label": [f"{MANAGED_LABEL}=1", *(f"{k}={v}" for k, v in labels.items())]}
    found: list[Any] = client.containers.list(all=True, filters=filters)
    return found


def _remove(client: Any, marker: str) -> None:
    for container in _containers(client, **{"test.marker": marker}):
        container.remove(force=True)


async def test_a_docker_worker_runs_the_agents_command_in_a_container(
    real_log: EventLog, procs: Processes, docker_image: str, docker_client: Any  # noqa: F811
) -> None:
    marker = f"echo-{os.getpid()}"
    start_finalizer(procs)
    docker_worker(procs, "wD", docker_image)
    try:
        await start_rollout(
            real_log, "rd", n_prompts=2, evaluator_id="boxed",
            script=lambda i: {
                "marker": marker,
                # pid 1 of a sandbox container is Docker's init, never this machine's.
                "sandbox_command": "echo pid1=$(cat /proc/1/comm) net=$(ls /sys/class/net)",
            },
        )
        ready = await RolloutClient(real_log).wait_ready("rd", timeout=60)
        assert (ready.n_completed, ready.n_aborted) == (2, 0), procs.output("wD")
        samples = await RolloutClient(real_log).load("rd")
        for sample in samples:
            assert sample.response == "exit=0 out=pid1=docker-init net=lo", sample.response
        # Each episode stopped its container.
        assert _containers(docker_client, **{"test.marker": marker}) == []
    finally:
        _remove(docker_client, marker)


async def test_limits_labels_and_reaping_after_a_sigkill(
    real_log: EventLog, procs: Processes, docker_image: str, docker_client: Any  # noqa: F811
) -> None:
    marker = f"reap-me-{os.getpid()}"
    start_finalizer(procs)
    docker_worker(procs, "wA", docker_image)
    try:
        await start_rollout(
            real_log, "rk", n_prompts=2, evaluator_id="boxed",
            script=lambda i: {"sandbox_hang_attempts": [1], "marker": marker} if i == 0 else {},
        )

        async def container_running() -> Any:
            while True:
                found = [c for c in _containers(docker_client, **{"test.marker": marker})
                         if c.status == "running"]
                if found:
                    return found[0]
                await asyncio.sleep(0.1)

        container = await asyncio.wait_for(container_running(), 60)
        host = container.attrs["HostConfig"]
        assert host["NanoCpus"] == int(RUN_CPU * 1e9)
        assert host["Memory"] == int(RUN_MEMORY_GB * 1024) * 2**20
        assert host["MemorySwap"] == host["Memory"]  # no swap
        assert host["PidsLimit"] and host["PidsLimit"] > 0
        assert host["NetworkMode"] == "none"
        labels = container.labels
        assert labels["rollout.worker"] == "wA"
        assert labels["rollout.rollout"] == "rk"
        assert labels["rollout.batch"] == "rk:b0"
        assert labels["rollout.sample"] == "rk:s0"

        assert procs.kill("wA") == -signal.SIGKILL
        # The dead worker's container outlives it...
        assert _containers(docker_client, **{"rollout.worker": "wA"})
        docker_worker(procs, "wB", docker_image)
        ready = await RolloutClient(real_log).wait_ready("rk", timeout=60)
        assert ready.n_completed == 2, procs.output("wB")
        # ...until the worker that claims the batch reaps it.
        assert _containers(docker_client, **{"rollout.worker": "wA"}) == []
        assert "reaped 1 sandboxes wA left for batch rk:b0" in procs.output("wB")
    finally:
        _remove(docker_client, marker)


async def test_a_docker_worker_refuses_to_start_without_the_image(
    real_log: EventLog, procs: Processes, docker_image: str  # noqa: F811 - the daemon is up
) -> None:
    docker_worker(procs, "wX", "rollout-sandbox-test:no-such-tag")
    assert await asyncio.to_thread(procs.wait, "wX", 60) == 2
    output = procs.output("wX")
    assert "--sandbox docker" in output and "no-such-tag" in output, output
