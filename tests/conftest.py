"""Shared fixtures: Redis backends (fakeredis and a real redis-server)."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable, Iterator

import fakeredis
import pytest
import redis.asyncio as aioredis

from engine.events import RedisEventLog, RedisSettings, connect
from tests.redis_server import RedisServer, redis_required, start_redis_server

ClientFactory = Callable[[], aioredis.Redis]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        if redis_required():
            pytest.fail("redis-server is missing in CI: .ci/run must install it")
        pytest.skip("redis-server binary not installed")
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture(params=["fakeredis", "redis-server"])
async def redis_factory(request: pytest.FixtureRequest) -> AsyncIterator[ClientFactory]:
    """A factory of clients that all talk to one fresh, empty Redis."""
    clients: list[aioredis.Redis] = []
    if request.param == "fakeredis":
        server = fakeredis.FakeServer(version=(7, 0))

        def make() -> aioredis.Redis:
            client = fakeredis.FakeAsyncRedis(server=server)
            clients.append(client)
            return client
    else:
        real: RedisServer = request.getfixturevalue("redis_server")
        settings = RedisSettings(url=real.url, block_ms=500)
        admin = connect(settings)
        await admin.flushall()
        await admin.aclose()

        def make() -> aioredis.Redis:
            client = connect(settings)
            clients.append(client)
            return client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
async def log(redis_factory: ClientFactory) -> RedisEventLog:
    return RedisEventLog(redis_factory(), producer="test", block_ms=200, max_deliveries=3)
