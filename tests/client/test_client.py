"""The trainer client: request, wait, subscribe, load, collate (sync and async)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch

from engine.client import RolloutClient, SyncRolloutClient, collate
from engine.events import EventLog, RolloutReady, RolloutRequested
from engine.sample import Sample
from tests.actors.play import play_scheduler
from tests.faults.harness import RestartableRedis
from tests.redis_server import RedisServer
from tests.rig import Engine


def _sample(prompt: tuple[int, ...], response: tuple[int, ...], mask: tuple[int, ...],
            reward: float | dict[str, float] = 1.0,
            teacher: tuple[float, ...] | None = None) -> Sample:
    return Sample(
        index=0, group_index=0, tokens=(*prompt, *response), response_length=len(response),
        loss_mask=mask, rollout_log_probs=tuple(-0.5 for _ in response), reward=reward,
        teacher_log_probs=teacher,
    )


def test_collate_right_pads_and_masks_the_prompt() -> None:
    a = _sample((1, 2, 3), (4, 5), (1, 0), reward=1.0)
    b = _sample((6,), (7, 8, 9, 10), (1, 1, 0, 1), reward={"score": 0.5, "format": 1.0})
    dummy = Sample.masked_dummy()
    batch = collate([a, b, dummy], pad_token_id=-1)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [0, 0, -1, -1, -1]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1] * 5, [1, 1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 0], [0, 1, 1, 0, 1], [0] * 5]
    assert batch["rollout_log_probs"][0].tolist() == [0, 0, 0, -0.5, -0.5]
    assert batch["rewards"].tolist() == [1.0, 0.5, 0.0]
    assert batch["response_lengths"].tolist() == [2, 4, 2]
    assert batch["prompt_lengths"].tolist() == [3, 1, 0]
    assert batch["remove_sample"].tolist() == [False, False, True]
    assert batch["tokens"].dtype == torch.long and batch["loss_mask"].dtype == torch.float32
    assert "teacher_log_probs" not in batch


def test_collate_carries_teacher_logprobs_when_every_sample_has_them() -> None:
    a = _sample((1,), (2, 3), (1, 1), teacher=(-0.25, -0.5))
    batch = collate([a])
    assert batch["teacher_log_probs"].tolist() == [[0.0, -0.25, -0.5]]
    with pytest.raises(ValueError):
        collate([])


async def test_request_then_ready_then_load(engine: Engine, log: EventLog) -> None:
    engine.start_worker()
    engine.start_finalizer()
    client = RolloutClient(log)
    rid = await client.request(
        iteration=7, n_prompts=2, n_samples_per_prompt=2, policy_version=4,
        knobs={"dagger_beta": 0.5}, seed=11,
    )
    assert rid.startswith("it7-")
    (request,) = [e.event for e in await log.read_all(log.names.control)]
    assert isinstance(request, RolloutRequested)
    assert (request.iteration, request.seed, request.knobs) == (7, 11, {"dagger_beta": 0.5})
    assert not request.teacher_capture
    await play_scheduler(log, request)
    ready = await client.wait_ready(rid, timeout=30)
    assert ready.iteration == 7 and ready.policy_version == 4
    samples = await client.load(rid)
    assert [s.index for s in samples] == [0, 1, 2, 3]
    batch = collate(samples)
    assert batch["tokens"].shape == (4, 8)
    # Waiting again (another client, after the fact) finds the same answer.
    assert await RolloutClient(log).wait_ready(rid, timeout=5) == ready


async def test_teacher_capture_follows_the_algorithm(log: EventLog) -> None:
    client = RolloutClient(log)
    await client.request(iteration=0, n_prompts=1, algorithm="opd", rollout_id="a")
    await client.request(iteration=0, n_prompts=1, algorithm="grpo", rollout_id="b")
    flags = [
        e.event.teacher_capture
        for e in await log.read_all(log.names.control)
        if isinstance(e.event, RolloutRequested)
    ]
    assert flags == [True, False]


async def test_wait_ready_times_out(log: EventLog) -> None:
    client = RolloutClient(log)
    rid = await client.request(iteration=0, n_prompts=1)
    with pytest.raises(TimeoutError):
        await client.wait_ready(rid, timeout=0.3)


async def test_subscribe_ready_yields_new_rollouts(log: EventLog) -> None:
    client = RolloutClient(log)

    async def first() -> RolloutReady:
        async for ready in client.subscribe_ready():
            return ready
        raise AssertionError("subscription ended")

    task = asyncio.create_task(first())
    await asyncio.sleep(0)  # let the subscription take its position
    while not task.done():
        await log.append(log.names.control, RolloutReady(rollout_id="z", sample_ids=[]))
        await asyncio.wait([task], timeout=0.2)
    assert task.result().rollout_id == "z"


@pytest.mark.parametrize("log_backend", ["redis-server"])
async def test_sync_client(engine: Engine, log: EventLog, redis_server: RedisServer) -> None:
    engine.start_worker()
    engine.start_finalizer()

    def trainer_step() -> tuple[str, int]:
        with SyncRolloutClient(redis_server.url, block_ms=200) as client:
            rid = client.request(iteration=1, n_prompts=1, n_samples_per_prompt=3, rollout_id="s1")
            return rid, len(client.load(rid)) if client.wait_ready(rid, timeout=30) else 0

    async def scheduler() -> None:
        entries, _ = await log.read_after(log.names.control, "0-0", block_ms=20_000)
        request = entries[0].event
        assert isinstance(request, RolloutRequested)
        await play_scheduler(log, request)

    (rid, n), _ = await asyncio.gather(asyncio.to_thread(trainer_step), scheduler())
    assert (rid, n) == ("s1", 3)


async def test_wait_ready_waits_through_a_redis_restart(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed")
    server = RestartableRedis(tmp_path)
    server.start()
    client = RolloutClient.connect(server.url, block_ms=100)
    writer = RolloutClient.connect(server.url, block_ms=100)
    try:
        rid = await client.request(iteration=1, n_prompts=1, rollout_id="blip")
        waiting = asyncio.create_task(client.wait_ready(rid, timeout=60))
        await asyncio.sleep(0.3)  # blocked in its read
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(1.0)
        assert not waiting.done()  # the outage does not end the wait
        await asyncio.to_thread(server.start)
        await writer.log.append(writer.names.control, RolloutReady(rollout_id=rid, sample_ids=[]))
        ready = await asyncio.wait_for(waiting, 30)
        assert ready.rollout_id == rid
    finally:
        await client.aclose()
        await writer.aclose()
        server.stop()
