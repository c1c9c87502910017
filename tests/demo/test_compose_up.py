"""compose.yaml brought up for real: ``--profile cpu`` on a real dockerd, a training rollout
through its services, the model server crashed mid-rollout and brought back by compose's
restart policy.

The images come from ``scripts/build-images`` (no registry is needed: a base image made with
debootstrap, every wheel from the build context), which reuses them when nothing that goes
into them changed. The stack's Redis is published on a loopback port for this test only (an
override file); its password is read from the stack's own ``redis-secrets`` volume. Without a
dockerd the test is skipped; under CI (``CI=true`` or ``TEST_REQUIRE_DOCKER=require``) that
fails, and a failed build fails everywhere.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

from engine.client import RolloutClient
from engine.events.catalog import SampleAborted, SampleCompleted
from engine.outcomes import AbortClass
from tests.redis_server import redis_required

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]

ALLOWED_INFRA_CONN_ABORTS: int | None = 0
"""How many samples of the crash rollout may end as ``infra_conn`` aborts (None: any): none,
since a model call that finds the server dead waits for it and is retried."""

N_PROMPTS, N_PER_PROMPT = 32, 4  # long enough on tinylm that the crash lands mid-rollout


def _required() -> bool:
    return redis_required() or os.environ.get("TEST_REQUIRE_DOCKER", "").lower() == "require"


def _unavailable(reason: str) -> NoReturn:
    if _required():
        pytest.fail(f"under CI the compose test must run, but {reason}")
    pytest.skip(reason)


def _run(argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False, cwd=ROOT)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {done.returncode}:\n"
                             f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done


def _build_images(timeout: float) -> subprocess.CompletedProcess[str]:
    # The wheels are downloaded by this interpreter's pip (its find-links hold torch's CPU wheel).
    env = {**os.environ, "PYTHON": sys.executable}
    return _run(["bash", str(ROOT / "scripts" / "build-images")], env=env, timeout=timeout,
                check=False)


def _compose_binary() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if _run(["docker", "compose", "version"], check=False).returncode == 0:
        return ["docker", "compose"]
    return None


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """BASE_IMAGE and ENGINE_IMAGE as scripts/build-images prints them."""
    if shutil.which("docker") is None:
        _unavailable("no docker CLI")
    info = _run(["docker", "info"], check=False, timeout=60)
    if info.returncode != 0:
        _unavailable(f"no dockerd answers: {info.stderr.strip()[-500:]}")
    built = _build_images(timeout=1500)
    assert built.returncode == 0, f"scripts/build-images failed:\n{built.stderr[-5000:]}"
    lines = [line.split("=", 1) for line in built.stdout.splitlines() if "=" in line]
    found = {key: value for key, value in lines if key in ("BASE_IMAGE", "ENGINE_IMAGE")}
    assert set(found) == {"BASE_IMAGE", "ENGINE_IMAGE"}, built.stdout + built.stderr
    print(f"\nbuild-images:\n{built.stderr.strip()}")
    return found


@dataclass
class Stack:
    command: list[str]
    env: dict[str, str]
    images: dict[str, str]

    def compose(self, *args: str, timeout: float = 300,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([*self.command, *args], env=self.env, timeout=timeout, check=check)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.split()[0]

    def state(self, container: str, template: str) -> str:
        return _run(["docker", "inspect", "-f", template, container]).stdout.strip()

    def wait_healthy(self, container: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while (status := self.state(container, "{{.State.Health.Status}}")) != "healthy":
            assert time.monotonic() < deadline, f"{container} still {status} after {timeout} s"
            time.sleep(1)

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", check=False).stdout

    def redis_url(self) -> str:
        address = self.compose("port", "redis", "6379").stdout.strip()
        password = _run(["docker", "exec", self.container("redis"),
                         "cat", "/run/rollout-secrets/redis.password"]).stdout.strip()
        return f"redis://:{password}@{address}/0"

    def crash(self, container: str) -> None:
        """SIGKILL the container's main process, as an OOM kill or a segfault would end it.

        (``docker kill`` marks a container stopped on purpose, and no restart policy brings
        it back; the kill comes from a helper in the host's pid namespace, so it works for a
        user in the docker group as for root.)"""
        pid = self.state(container, "{{.State.Pid}}")
        assert int(pid) > 1, pid
        _run(["docker", "run", "--rm", "--pid", "host", "--network", "none",
              self.images["BASE_IMAGE"], "kill", "-KILL", pid])


@pytest.fixture
def stack(images: dict[str, str], tmp_path: Path) -> Iterator[Stack]:
    command = _compose_binary()
    if command is None:
        _unavailable("no docker-compose (apt-get install docker-compose)")
    override = tmp_path / "compose.publish-redis.yaml"
    override.write_text('services:\n  redis:\n    ports: ["127.0.0.1::6379"]\n')
    project = f"rollout-test-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CERT_PATH")}
    env.update(REDIS_IMAGE=images["BASE_IMAGE"], ENGINE_IMAGE=images["ENGINE_IMAGE"],
               TINYLM_INIT_STEPS="0")
    stack = Stack([*command, "-p", project, "-f", str(ROOT / "compose.yaml"),
                   "-f", str(override), "--profile", "cpu"], env, images)
    try:
        up = stack.compose("up", "-d", "--no-build", check=False)
        assert up.returncode == 0, f"compose up failed:\n{up.stderr[-3000:]}\n{stack.logs()}"
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", "-t", "5", check=False)


async def _outcomes(client: RolloutClient, rollout_id: str) -> tuple[Counter[str], list[str]]:
    """Terminal events of a rollout by outcome ('completed' or the abort class), and the
    stream ids of those events."""
    counts: Counter[str] = Counter()
    ids: list[str] = []
    for envelope in await client.log.read_all(client.names.rollout(rollout_id)):
        event = envelope.event
        if isinstance(event, SampleCompleted):
            counts["completed"] += 1
        elif isinstance(event, SampleAborted):
            counts[str(event.abort_class)] += 1
        else:
            continue
        ids.append(envelope.id)
    return counts, ids


def _id_after(a: str, b: str) -> bool:
    ms_a, _, seq_a = a.partition("-")
    ms_b, _, seq_b = b.partition("-")
    return (int(ms_a), int(seq_a or 0)) > (int(ms_b), int(seq_b or 0))


@pytest.mark.timeout(1800)
async def test_a_rollout_completes_through_a_model_server_crash(stack: Stack) -> None:
    began = time.monotonic()
    tinylm = stack.container("tinylm")
    stack.wait_healthy(tinylm)
    up_s = time.monotonic() - began
    client = RolloutClient.connect(stack.redis_url())
    try:
        total = N_PROMPTS * N_PER_PROMPT
        rollout = await client.request(
            iteration=0, n_prompts=N_PROMPTS, n_samples_per_prompt=N_PER_PROMPT
        )
        deadline = time.monotonic() + 300
        while not (await _outcomes(client, rollout))[0]["completed"]:
            assert time.monotonic() < deadline, "no sample completed in 300 s"
            await asyncio.sleep(0.2)
        before_crash = await client.log.last_id(client.names.rollout(rollout))
        restarts = int(stack.state(tinylm, "{{.RestartCount}}"))
        stack.crash(tinylm)

        ready, samples = await client.wait_load(rollout, timeout=600)
        counts, ids = await _outcomes(client, rollout)
        conn_aborts = counts[str(AbortClass.INFRA_CONN)]
        print(f"\ncompose stack up in {up_s:.0f} s; crash rollout: {total} samples, "
              f"{dict(counts)}; infra_conn aborts: {conn_aborts}")
        assert ready.n_completed + ready.n_aborted == total == len(samples)
        assert set(counts) <= {"completed", str(AbortClass.INFRA_CONN)}, counts
        assert any(_id_after(i, before_crash) for i in ids), "the crash came after the rollout"
        if ALLOWED_INFRA_CONN_ABORTS is not None:
            assert conn_aborts <= ALLOWED_INFRA_CONN_ABORTS, counts

        # The restart policy brings the same container back, and it serves again.
        deadline = time.monotonic() + 300
        while int(stack.state(tinylm, "{{.RestartCount}}")) <= restarts:
            assert time.monotonic() < deadline, "the model server was not restarted"
            await asyncio.sleep(1)
        assert stack.container("tinylm") == tinylm
        stack.wait_healthy(tinylm)
        after = await client.request(iteration=1, n_prompts=4, n_samples_per_prompt=2)
        ready, _ = await client.wait_load(after, timeout=300)
        assert (ready.n_completed, ready.n_aborted) == (8, 0), await _outcomes(client, after)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        await client.aclose()
    print(f"compose test body {time.monotonic() - began:.0f} s")


@pytest.mark.timeout(1800)
def test_a_second_build_reuses_the_images(images: dict[str, str]) -> None:
    again = _build_images(timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"BASE_IMAGE={images['BASE_IMAGE']}" in again.stdout
    assert f"ENGINE_IMAGE={images['ENGINE_IMAGE']}" in again.stdout
    assert "built in" not in again.stderr, again.stderr
