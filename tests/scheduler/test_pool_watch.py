"""The scheduler's pool follower rides out a Redis outage: it backs off and resumes folding."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.actors.admission import PoolGate
from engine.errors import LogUnavailable
from engine.events import NodeDecl, PoolDeclared
from engine.events.base import Envelope
from engine.events.redis_log import RedisEventLog
from engine.runtime.consumer import Backoff


class _Flaky:
    """The log, except that its first ``failures`` blocking reads fail as an outage."""

    def __init__(self, log: RedisEventLog, failures: int) -> None:
        self._log = log
        self.failures = failures
        self.calls = 0

    async def read_after(self, stream: str, after: str, **kwargs: Any) -> tuple[
        list[Envelope], str
    ]:
        self.calls += 1
        if self.failures > 0:
            self.failures -= 1
            raise LogUnavailable("redis at 127.0.0.1:1 is unreachable (test)")
        return await self._log.read_after(stream, after, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


async def test_the_pool_watch_backs_off_through_an_outage_and_keeps_folding(
    log: RedisEventLog,
) -> None:
    flaky = _Flaky(log, failures=3)
    gate = PoolGate(flaky, backoff=Backoff(first_s=0.01, max_s=0.02))
    watch = asyncio.create_task(gate.pool.run())
    decl = PoolDeclared(nodes=[NodeDecl(node="n0", gpus=[0], cpu=4, memory_gb=8)])
    await log.append(log.names.pool, decl)
    for _ in range(200):
        if gate.state.declared is not None:
            break
        await asyncio.sleep(0.01)
    declared = gate.state.declared
    assert declared is not None, "the watch stopped folding after the outage"
    assert declared.nodes == decl.nodes
    assert flaky.failures == 0 and flaky.calls >= 4
    assert not watch.done(), "an outage must not end the watch (it would stop the scheduler)"
    gate.close()
    await asyncio.wait_for(watch, 5)


async def test_close_cuts_a_backoff_pause_short(log: RedisEventLog) -> None:
    gate = PoolGate(_Flaky(log, failures=10**6), backoff=Backoff(first_s=60, max_s=60))
    watch = asyncio.create_task(gate.pool.run())
    await asyncio.sleep(0.05)  # now in its first 60 s pause
    gate.close()
    await asyncio.wait_for(watch, 2)
