"""A pool whose policy servers change while it serves (``BackendPool.use_servers``, what a
worker following the registry on ``rl:control`` calls): a new server takes trajectories only
once the health probe admits it at the active version; a retired one takes none and the
trajectories placed on it move at their next call; with none listed, calls wait."""

from __future__ import annotations

import asyncio

import pytest

from engine.backends.health import RetryBudget, ServerState
from engine.backends.pool import BackendPool
from engine.errors import ConfigError, ServersDown
from tests.backends.test_health import PARAMS, FakeServer

A, B = "http://a:1", "http://b:2"


def pool_of(*urls: str, outage_limit_s: float = 30.0) -> tuple[BackendPool, dict[str, FakeServer]]:
    servers: dict[str, FakeServer] = {}

    def build(url: str) -> FakeServer:
        servers[url] = FakeServer(url)
        return servers[url]

    pool = BackendPool(list(urls), build=build, outage_limit_s=outage_limit_s)
    pool.health.expected = lambda: 1
    return pool, servers


async def turn(view: BackendPool) -> str:
    backend = view.get()
    await backend.generate(input_ids=[1, 2], sampling_params=PARAMS)
    return backend.base_url  # the server the call went to


async def test_a_registered_server_takes_trajectories_once_admitted_at_the_active_version() -> (
    None
):
    # Given a pool on A with a trajectory on it
    pool, servers = pool_of(A)
    first = pool.bind("r:s0/a1", budget=RetryBudget(backoff_s=0.0))
    assert await turn(first) == A
    # When B is registered
    pool.use_servers([A, B])
    # Then it is not up until a probe finds it at the active version: new work stays on A
    assert pool.default_urls == (A, B) and pool.health.states[B] is ServerState.DOWN
    second = pool.bind("r:s1/a1", budget=RetryBudget(backoff_s=0.0))
    assert await turn(second) == A
    pool.get(B)  # the probe's backend
    servers[B].version = 0
    await pool.health.probe(B)
    assert pool.health.states[B] is ServerState.STALE  # another version: a sync first
    servers[B].version = 1
    await pool.health.probe(B)
    assert pool.health.is_up(B)
    third = pool.bind("r:s2/a1", budget=RetryBudget(backoff_s=0.0))
    assert await turn(third) == B  # the least loaded takes the new trajectory
    assert await turn(first) == A  # and placed ones stay where they are
    assert pool.load() == {A: 2, B: 1}


async def test_a_retired_server_gets_nothing_and_its_trajectories_move() -> None:
    # Given two servers, each with a trajectory
    pool, servers = pool_of(A, B)
    views = [pool.bind(f"r:s{i}/a1", budget=RetryBudget(backoff_s=0.0)) for i in range(2)]
    placed = {await turn(v) for v in views}
    assert placed == {A, B}
    on_a = next(v for v in views if pool.server_of(v.key or "") == A)
    calls_on_a = len(servers[A].calls)
    # When A is retired
    pool.use_servers([B])
    # Then its trajectory moves to B at its next call, and nothing new goes to A
    assert pool.default_urls == (B,) and A not in pool.health.states
    assert await turn(on_a) == B
    fresh = [pool.bind(f"r:n{i}/a1", budget=RetryBudget(backoff_s=0.0)) for i in range(3)]
    for view in fresh:
        await view.get().generate(input_ids=[1], sampling_params=PARAMS)
    assert len(servers[A].calls) == calls_on_a and len(servers[B].calls) == 5


async def test_with_no_server_listed_calls_wait_for_one_and_past_the_outage_limit_fail() -> None:
    # A pool that never had a server has no endpoint at all
    with pytest.raises(ConfigError, match="no model endpoint"):
        pool_of()[0].get()
    # Given a pool whose only server is retired
    pool, servers = pool_of(A, outage_limit_s=0.5)
    view = pool.bind("r:s0/a1", budget=RetryBudget(backoff_s=0.0))
    pool.use_servers([])
    assert not pool.health.any_up
    # When a turn starts, it waits; a server registered and admitted takes it
    call = asyncio.create_task(view.get().generate(input_ids=[1, 2], sampling_params=PARAMS))
    await asyncio.sleep(0.05)
    assert not call.done()
    pool.use_servers([B])
    pool.get(B)
    await pool.health.probe(B)
    result = await asyncio.wait_for(call, 5)
    assert result.token_ids == (7, 8) and servers[B].calls and not servers[A].calls
    # And with none again for longer than the outage limit, the wait fails naming it
    pool.use_servers([])
    with pytest.raises(ServersDown, match="every policy server has been down"):
        await asyncio.wait_for(
            view.get().generate(input_ids=[1, 2], sampling_params=PARAMS), 10
        )
