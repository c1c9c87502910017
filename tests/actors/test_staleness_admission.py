"""The scheduler admits no batch of a rollout whose staleness bound no published version can
meet: a request whose ``policy_version`` is more than ``max_staleness`` ahead of the highest
``PolicyVersionPublished`` waits, following ``rl:control``, and is admitted once a version
within its bound is published. Nor, under the ``pace`` policy, one whose samples could miss
the bound: it waits until the rollouts ahead of it are trained on and the new version is
active. A real redis-server and the engine's scheduler; the decisions themselves are
:func:`engine.actors.planning.admission_wait` and :func:`~engine.actors.planning.pace_wait`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from engine.actors.planning import Planner, admission_wait
from engine.actors.scheduler import Scheduler, SchedulerConfig
from engine.config.rollout import load_rollout_config
from engine.domain import EvaluatorProfile, Resource
from engine.events import (
    BatchAdmitted,
    Envelope,
    EventLog,
    PolicyVersionActivated,
    PolicyVersionPublished,
    RolloutReady,
    RolloutRequested,
)
from engine.events.redis_log import RedisEventLog, RedisSettings
from engine.events.redis_log import connect as redis_connect
from engine.projections.base import fold, start
from engine.projections.rollout import RolloutProjection
from tests.redis_server import RedisServer
from tests.scheduler.helpers import write_config

EVALUATOR = "turns"


def test_the_wait_is_a_pure_function_of_the_request_and_the_published_version() -> None:
    def state(**kw: object) -> object:
        req = RolloutRequested.model_validate({"rollout_id": "r", "n_prompts": 1, **kw})
        projection = RolloutProjection()
        return fold(projection, start(projection), [Envelope("s", "1-0", req)]).state

    bounded = state(policy_version=5, max_staleness=1)
    assert admission_wait(bounded, None) is None  # nothing published: the starting weights
    assert "version 4 or newer; the highest published is 3" in str(admission_wait(bounded, 3))
    assert admission_wait(bounded, 4) is None
    assert admission_wait(bounded, 9) is None  # the floor moves up with it: 8 <= 9
    assert admission_wait(state(policy_version=5), 0) is None  # no bound


async def _admitted(log: EventLog, rollout_id: str) -> list[BatchAdmitted]:
    return [
        e.event for e in await log.read_all(log.names.work(EVALUATOR))
        if isinstance(e.event, BatchAdmitted) and e.event.rollout_id == rollout_id
    ]


async def test_admission_waits_for_a_version_within_the_bound(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()

    def new_log() -> RedisEventLog:
        return RedisEventLog(redis_connect(RedisSettings(url=redis_server.url, block_ms=200)),
                             producer="test", block_ms=200)

    profile = EvaluatorProfile(evaluator_id=EVALUATOR, resource=Resource(concurrency=4),
                               batch_size=4)
    config = write_config(tmp_path, {"ds": (EVALUATOR, 20)}, {"ev": (EVALUATOR, 2)})
    scheduler = Scheduler(
        new_log(),
        planner=Planner(load_rollout_config(config), {EVALUATOR: profile}),
        layout=None,
        config=SchedulerConfig(scheduler_id="s0", block_ms=200, heartbeat_ms=1000,
                               claim_idle_ms=5000),
    )
    log = new_log()
    stop = asyncio.Event()
    await scheduler.start()
    running = asyncio.create_task(scheduler.run(stop))
    try:
        await log.append(log.names.control, PolicyVersionPublished(version=3))
        await log.append(log.names.control, RolloutRequested(
            rollout_id="ahead", n_prompts=2, n_samples_per_prompt=2, policy_version=5,
            max_staleness=1,
        ))
        await log.append(log.names.control, RolloutRequested(
            rollout_id="free", n_prompts=2, n_samples_per_prompt=2, policy_version=5,
        ))
        # the unbounded request is admitted; the bounded one is planned but waits
        async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
            while not await predicate():
                await asyncio.sleep(0.05)

        async def free_admitted() -> bool:
            return bool(await _admitted(log, "free"))

        async def ahead_waits() -> bool:
            return scheduler.version_waits > 0

        await asyncio.wait_for(until(free_admitted), 30)
        await asyncio.wait_for(until(ahead_waits), 30)
        assert await _admitted(log, "ahead") == []
        # version 4 meets the floor (5 - 1): its batches go out
        await log.append(log.names.control, PolicyVersionPublished(version=4))

        async def ahead_admitted() -> bool:
            return len(await _admitted(log, "ahead")) == 1

        await asyncio.wait_for(until(ahead_admitted), 30)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await log.aclose()
        await scheduler.log.aclose()


async def test_a_paced_rollout_waits_for_the_step_on_the_one_before_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis = redis_connect(RedisSettings(url=redis_server.url))
    await redis.flushall()
    await redis.aclose()

    def new_log() -> RedisEventLog:
        return RedisEventLog(redis_connect(RedisSettings(url=redis_server.url, block_ms=200)),
                             producer="test", block_ms=200)

    profile = EvaluatorProfile(evaluator_id=EVALUATOR, resource=Resource(concurrency=4),
                               batch_size=4)
    config = write_config(tmp_path, {"ds": (EVALUATOR, 20)}, {"ev": (EVALUATOR, 2)})
    scheduler = Scheduler(
        new_log(),
        planner=Planner(load_rollout_config(config), {EVALUATOR: profile}),
        layout=None,
        config=SchedulerConfig(scheduler_id="s0", block_ms=200, heartbeat_ms=1000,
                               claim_idle_ms=5000),
    )
    log = new_log()
    stop = asyncio.Event()
    await scheduler.start()
    running = asyncio.create_task(scheduler.run(stop))

    async def until(predicate: Callable[[], Awaitable[bool]]) -> None:
        while not await predicate():
            await asyncio.sleep(0.05)

    async def waits_after(count: int) -> bool:  # it looked again and still waits
        return scheduler.version_waits > count

    try:
        # given two paced rollouts with max_staleness 0, requested back to back
        for rid in ("first", "second"):
            await log.append(log.names.control, RolloutRequested(
                rollout_id=rid, n_prompts=2, n_samples_per_prompt=2, max_staleness=0,
                staleness_policy="pace",
            ))

        async def admitted(rid: str) -> bool:
            return bool(await _admitted(log, rid))

        # then the first is admitted and the second waits
        await asyncio.wait_for(until(lambda: admitted("first")), 30)
        await asyncio.wait_for(until(lambda: waits_after(0)), 30)
        # when the first is ready and its step's weights are published, not yet active
        await log.append(log.names.control, RolloutReady(rollout_id="first", sample_ids=[]))
        await log.append(log.names.control, PolicyVersionPublished(version=1))
        await scheduler.control.wait_for(lambda s: s.published == 1)
        seen = scheduler.version_waits
        await asyncio.wait_for(until(lambda: waits_after(seen)), 30)
        assert await _admitted(log, "second") == []  # it looked with both and still waits
        # when version 1 is active, the second is admitted
        await log.append(log.names.control, PolicyVersionActivated(version=1, servers=["s"]))
        await asyncio.wait_for(until(lambda: admitted("second")), 30)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)
        await log.aclose()
        await scheduler.log.aclose()
