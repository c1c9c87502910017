"""Workers and the syncer follow the policy servers registered on ``rl:control``, live
(``ROLLOUT_SERVERS_FROM_LOG``): real tinylm processes, the engine's worker and syncer
processes (``engine.ops.processes``) and a real redis-server. The registrations are appended
as ``rollout serve`` appends them (tests/ops/test_serve.py runs the supervisor itself)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.events import (
    EventLog,
    PolicyVersionActivated,
    PolicyVersionPublished,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    ServerUp,
)
from engine.events.catalog.servers import ServerRegistered, ServerRetired
from engine.ops.processes import Processes
from engine.ops.tinylm import RL_SERVER_ENV
from tests.actors.play import play_scheduler
from tests.redis_server import RedisServer
from tests.rig import launcher

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]

CONFIG = Path(__file__).parent / "fixtures" / "discovery_evaluators.py"
ACTIVE = 1


def registered(url: str, version: int | None = ACTIVE) -> ServerRegistered:
    return ServerRegistered(endpoint=url, backend="tinylm", supervisor="test",
                            weight_version=version)  # fmt: skip


async def control_until(log: EventLog, found: Callable[[list[Any]], bool],
                        timeout: float = 120.0) -> list[Any]:  # fmt: skip
    async def wait() -> list[Any]:
        while True:
            events = [e.event for e in await log.read_all(log.names.control)]
            if found(events):
                return events
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(wait(), timeout)


async def server_info(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as client:
        info: dict[str, Any] = (await client.get(url + "/get_server_info")).json()
        return info


async def until_running(url: str, rollout_id: str, timeout: float = 120.0) -> None:
    """Until a generation of the rollout runs on the server."""

    async def wait() -> None:
        while not any(r.startswith(f"{rollout_id}:") for r in
                      (await server_info(url))["running_rids"]):  # fmt: skip
            await asyncio.sleep(0.02)

    await asyncio.wait_for(wait(), timeout)


async def idle(url: str, rollout_id: str, timeout: float = 60.0) -> int:
    """Once no generation of the rollout runs on the server: its forward steps so far."""

    async def wait() -> int:
        while True:
            info = await server_info(url)
            if not any(r.startswith(f"{rollout_id}:") for r in info["running_rids"]):
                return int(info["forward_steps"])
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(wait(), timeout)


async def finished(log: EventLog, rollout_id: str, n: int, timeout: float = 180.0) -> list[Any]:
    async def wait() -> list[Any]:
        while True:
            events = [e.event for e in await log.read_all(log.names.rollout(rollout_id))]
            if sum(isinstance(e, SampleCompleted | SampleAborted) for e in events) >= n:
                return events
            await asyncio.sleep(0.1)

    return await asyncio.wait_for(wait(), timeout)


def tinylm(procs: Processes, name: str, model: Path, version: int = ACTIVE) -> str:
    return procs.serve_tinylm(name, model, "--weight-version", str(version),
                              env=RL_SERVER_ENV).url  # fmt: skip


async def test_a_worker_waits_for_a_server_and_follows_registrations_and_retirements(
    real_log: EventLog, redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    log = real_log
    await log.append(log.names.control, PolicyVersionActivated(version=ACTIVE, servers=[]))
    with launcher(redis_server.url, tmp_path / "logs", outage_limit_s=120.0) as procs:
        a, b = tinylm(procs, "a", tinylm_dir), tinylm(procs, "b", tinylm_dir)
        # A worker started before any server is registered waits for one.
        procs.start("w1", "worker", settings={
            "worker_id": "w1", "evaluator_config": CONFIG, "evaluators": "turns",
            "sandbox": "none", "servers_from_log": True, "stall_s": 30.0})  # fmt: skip
        req = RolloutRequested(rollout_id="r1", n_prompts=6, n_samples_per_prompt=2)
        await log.append(log.names.control, req)
        await play_scheduler(log, req, evaluator_id="turns", batch_size=16)
        await log.append(log.names.control, registered(a))
        await until_running(a, "r1")
        b_before = int((await server_info(b))["forward_steps"])

        # A is retired and B registered mid-rollout: once the worker says B is up (it has
        # folded both), nothing new goes to A, and B serves the rest of the rollout.
        await log.append(log.names.control, ServerRetired(endpoint=a, supervisor="test"))
        await log.append(log.names.control, registered(b))
        await control_until(log, lambda evs: any(
            isinstance(e, ServerUp) and e.endpoint == b and e.worker == "w1" for e in evs))
        a_steps = await idle(a, "r1")  # the turns sent to A before its retirement end there
        await until_running(b, "r1")
        events = await finished(log, "r1", 12)
        procs.check_alive()
        assert sum(isinstance(e, SampleCompleted) for e in events) == 12
        assert not [e for e in events if isinstance(e, SampleAborted)]
        assert int((await server_info(a))["forward_steps"]) == a_steps  # A got nothing after
        assert int((await server_info(b))["forward_steps"]) > b_before + 32

        # A is registered again (a scale-up): the next rollout runs on both.
        await log.append(log.names.control, registered(a))
        await control_until(log, lambda evs: [
            e.endpoint for e in evs if isinstance(e, ServerUp) and e.worker == "w1"
        ].count(a) >= 2)  # fmt: skip
        req = RolloutRequested(rollout_id="r2", n_prompts=6, n_samples_per_prompt=2)
        await log.append(log.names.control, req)
        await play_scheduler(log, req, evaluator_id="turns", batch_size=16)
        await asyncio.gather(until_running(a, "r2"), until_running(b, "r2"))
        events = await finished(log, "r2", 12)
        assert sum(isinstance(e, SampleCompleted) for e in events) == 12


async def test_a_syncer_brings_a_server_registered_after_the_activation_to_the_active_version(
    real_log: EventLog, redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    log = real_log
    with launcher(redis_server.url, tmp_path / "logs") as procs:
        a = tinylm(procs, "a", tinylm_dir, version=0)
        await log.append(log.names.control, registered(a, version=0))
        procs.start("sync", "sync", settings={"servers_from_log": True})
        v1 = tmp_path / "ckpt" / "v1"
        shutil.copytree(tinylm_dir, v1)
        await log.append(log.names.control,
                         PolicyVersionPublished(version=1, weights_uri=f"file://{v1}"))  # fmt: skip
        events = await control_until(
            log, lambda evs: any(isinstance(e, PolicyVersionActivated) for e in evs)
        )
        (activated,) = [e for e in events if isinstance(e, PolicyVersionActivated)]
        assert activated.servers == [a] and (await server_info(a))["weight_version"] in ("0", "1")
        # B starts from the base model after the activation and is registered at version 0.
        b = tinylm(procs, "b", tinylm_dir, version=0)
        await log.append(log.names.control, registered(b, version=0))

        async def version_of(url: str) -> str:
            async with httpx.AsyncClient(timeout=10) as client:
                return str((await client.get(url + "/get_model_info")).json()["weight_version"])

        async def loaded() -> None:
            while await version_of(b) != "1":
                await asyncio.sleep(0.1)

        await asyncio.wait_for(loaded(), 60)
        assert await version_of(a) == "1"
        procs.check_alive()
