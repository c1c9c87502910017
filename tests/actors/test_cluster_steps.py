"""Planning and admission as single-slot steps, interrupted at every step.

On a Redis Cluster the scheduler may not write a rollout stream and the control plane in one
script, so a plan is written in steps: the cursor on ``rl:data``, then the plan's chunks on
the rollout stream (each a compare-and-append chained on the one before), then per batch one
admission (pool + work stream, one slot) and finally ``AdmissionClosed``. These tests kill a
scheduler at every one of those steps, both before the step reaches Redis and after it
landed with its reply lost, and let a second scheduler resume the request: every plan event,
cursor, acquisition and admission must then be on the log exactly once, and the next
rollout must continue the data cursor. They run on fakeredis and on a real 3-master cluster.

The finalizer's decision is split the same way (``RolloutReady`` by compare-and-append on
the rollout stream, then its copy on ``rl:control`` with ``append_once``); a finalizer
killed at either step is followed by one that leaves exactly one of each.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import fakeredis
import pytest

from engine.actors.planning import Planner
from engine.client import RolloutClient
from engine.config.rollout import load_rollout_config
from engine.events import (
    AdmissionClosed,
    BatchAdmitted,
    DataCursorAdvanced,
    Envelope,
    Event,
    EventLog,
    RolloutReady,
    TokenAcquired,
)
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.projections.data_cursor import DataState
from tests.events.redis_cluster import RedisClusterProcs, cluster_fixture
from tests.rig import Engine, events_of, start_rollout, wait_state
from tests.scheduler.helpers import load_specs, make_scheduler, request, write_config

CHUNK = 5


class Crash(BaseException):
    """The scheduler process dies here (nothing in the engine catches a BaseException)."""


class CrashingLog:
    """The log as one scheduler process sees it, dying at write number ``at``: before the
    write reaches Redis (``landed=False``) or right after it landed, its reply lost."""

    def __init__(self, log: EventLog, at: int | None, *, landed: bool) -> None:
        self._log = log
        self._at = at
        self._landed = landed
        self.writes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)

    async def _write(self, call: Any) -> Any:
        step = self.writes
        self.writes += 1
        if step == self._at and not self._landed:
            raise Crash(f"before write {step}")
        result = await call()
        if step == self._at:
            raise Crash(f"after write {step}")
        return result

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        return await self._write(lambda: self._log.append(*args, **kwargs))

    async def append_many(self, *args: Any, **kwargs: Any) -> Any:
        return await self._write(lambda: self._log.append_many(*args, **kwargs))

    async def append_if_last(self, *args: Any, **kwargs: Any) -> Any:
        return await self._write(lambda: self._log.append_if_last(*args, **kwargs))

    async def append_once(self, *args: Any, **kwargs: Any) -> Any:
        return await self._write(lambda: self._log.append_once(*args, **kwargs))


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    yield from cluster_fixture()


@pytest.fixture(params=["fakeredis", "cluster"])
async def fresh(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A factory of logs on one empty store (call it again for a fresh store)."""
    logs: list[RedisEventLog] = []
    server: list[Any] = []

    async def make(new: bool = False) -> RedisEventLog:
        if request.param == "fakeredis":
            if new or not server:
                server[:] = [fakeredis.FakeServer(version=(7, 0))]
            client: Any = fakeredis.FakeAsyncRedis(server=server[0])
        else:
            cluster: RedisClusterProcs = request.getfixturevalue("redis_cluster")
            if new:
                cluster.flushall()
            client = connect(RedisSettings(url=cluster.url, block_ms=200))
        log = RedisEventLog(client, producer="test", block_ms=200)
        logs.append(log)
        return log

    yield make
    for log in logs:
        await log.aclose()


async def _run(log: Any, config: Path, rollout_id: str, env: Envelope) -> None:
    scheduler = make_scheduler(log, config, load_specs(), None, plan_chunk=CHUNK)
    await scheduler.handle(env, env.event)  # type: ignore[arg-type]


def _same(got: Sequence[Envelope], want: Sequence[Event]) -> None:
    assert [e.event.model_copy(update={"producer": "", "causation": None}) for e in got] == [
        ev.model_copy(update={"producer": "", "causation": None}) for ev in want
    ]


async def _check_exactly_once(log: EventLog, config: Path, rid: str) -> None:
    names = log.names
    req = request(rid, n_prompts=5, seed=3)
    plan = Planner(load_rollout_config(config), load_specs()).plan(req, DataState())
    _same(await log.read_all(names.rollout(rid)), plan.rollout_events())
    cursors = [e.event for e in await log.read_all(names.data)]
    assert [c for c in cursors if isinstance(c, DataCursorAdvanced)] == [
        plan.cursor.model_copy(update={"producer": cursors[0].producer,
                                       "causation": cursors[0].causation})
    ]
    pool = [e.event for e in await log.read_all(names.pool)]
    acquired = [e.batch_id for e in pool if isinstance(e, TokenAcquired)]
    batch_ids = [b.batch_id for b in plan.batches]
    assert sorted(acquired) == sorted(batch_ids)
    assert [e for e in pool if isinstance(e, AdmissionClosed)] == [
        AdmissionClosed(rollout_id=rid, producer="test", causation=pool[-1].causation)
    ]
    assert isinstance(pool[-1], AdmissionClosed)
    admitted = [e.event.batch_id for e in await log.read_all(names.work("math"))
                if isinstance(e.event, BatchAdmitted)]
    assert sorted(admitted) == sorted(batch_ids)


async def _request(log: EventLog, rid: str) -> Envelope:
    req = request(rid, n_prompts=5, seed=3)
    entry = await log.append(log.names.control, req)
    return Envelope(log.names.control, entry, req)


async def test_a_scheduler_killed_at_any_step_is_resumed_exactly_once(
    fresh: Any, tmp_path: Path
) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 40)})
    # A run without a crash counts the steps: cursor, plan chunks, admissions, close.
    log = await fresh(new=True)
    counting = CrashingLog(log, None, landed=False)
    await _run(counting, config, "r1", await _request(log, "r1"))
    steps = counting.writes
    plan = Planner(load_rollout_config(config), load_specs()).plan(
        request("r1", n_prompts=5, seed=3), DataState())
    chunks = -(-plan.n_events // CHUNK)
    assert steps == 1 + chunks + len(plan.batches) + 1
    assert chunks > 1 and len(plan.batches) > 1
    await _check_exactly_once(log, config, "r1")
    for at in range(steps):
        for landed in (False, True):
            log = await fresh(new=True)
            env = await _request(log, "r1")
            with pytest.raises(Crash):
                await _run(CrashingLog(log, at, landed=landed), config, "r1", env)
            await _run(await fresh(), config, "r1", env)  # the next scheduler process
            await _check_exactly_once(log, config, "r1")
            # ... and a second delivery of the request changes nothing
            await _run(await fresh(), config, "r1", env)
            await _check_exactly_once(log, config, "r1")
            # the next rollout continues r1's data cursor
            await _run(await fresh(), config, "r2", await _request(log, "r2"))
            cursors = {e.event.rollout_id: e.event for e in await log.read_all(log.names.data)
                       if isinstance(e.event, DataCursorAdvanced)}
            assert cursors["r2"].previous == cursors["r1"].cursor, (at, landed)


async def test_a_finalizer_killed_between_its_decision_and_the_copy_loses_no_copy(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    cases = [(at, landed) for at in (0, 1) for landed in (False, True)]
    for at, landed in cases:
        rid = f"f{at}{int(landed)}"
        await start_rollout(log, rid, n_prompts=2)
        await wait_state(log, rid, lambda s: s.n_terminal == 2, timeout=30)
        dying = engine.finalizer(f"dying-{rid}")
        dying.log = CrashingLog(dying.log, at, landed=landed)  # type: ignore[assignment]
        with pytest.raises(Crash):
            await asyncio.wait_for(dying.follow(rid), 30)
        for name in ("next", "another"):  # the next finalizer, then one more
            await asyncio.wait_for(engine.finalizer(f"{name}-{rid}").follow(rid), 30)
            assert len(await events_of(log, log.names.rollout(rid), RolloutReady)) == 1
            ready = [r for r in await events_of(log, log.names.control, RolloutReady)
                     if r.rollout_id == rid]
            assert len(ready) == 1, (at, landed)
        assert (await RolloutClient(log).wait_ready(rid, timeout=5)).n_completed == 2
