"""``BackendPool``: a worker's backends, one per model endpoint, shared by its episodes and
closed when it stops. Generations go over real sockets to the tinylm server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine.backends import BackendPool, ModelBackend, SGLangBackend, SGLangConfig
from engine.errors import BackendUnavailable, ConfigError
from tinylm.server import TinyLMServer

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]


class CountingTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that counts the requests it carried and knows if it was closed."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.requests = 0
        self.closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        self.closed = True
        await self._inner.aclose()


class Builds:
    """A pool's builder that keeps each backend's transport, by endpoint."""

    def __init__(self) -> None:
        self.transports: dict[str, CountingTransport] = {}

    def __call__(self, url: str) -> ModelBackend:
        assert url not in self.transports, f"{url} built twice"
        transport = self.transports[url] = CountingTransport()
        return SGLangBackend(config=SGLangConfig(url=url), transport=transport)


async def test_concurrent_generations_share_the_endpoints_one_backend(
    tinylm_server: TinyLMServer,
) -> None:
    builds = Builds()
    async with BackendPool(tinylm_server.url, build=builds) as pool:
        params = {"max_new_tokens": 4, "temperature": 0.0}
        results = await asyncio.gather(
            *(pool.get().generate(input_ids=PROMPT, sampling_params=params) for _ in range(6))
        )
        # The default endpoint and the same URL named explicitly are one endpoint.
        assert pool.get(tinylm_server.url + "/") is pool.get()
        assert pool.endpoints == (tinylm_server.url,)
    assert {len(r.token_ids or ()) for r in results} == {4}
    [transport] = builds.transports.values()
    assert transport.requests == 6 and transport.closed


async def test_each_endpoint_gets_its_own_backend() -> None:
    builds = Builds()
    pool = BackendPool("http://policy:30000", build=builds)
    policy, teacher = pool.get(), pool.get("http://teacher:30000/")
    assert policy is not teacher and pool.get("http://teacher:30000") is teacher
    assert pool.endpoints == ("http://policy:30000", "http://teacher:30000")
    await pool.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        pool.get()


def test_endpoints_are_validated() -> None:
    with pytest.raises(ConfigError, match="not-a-url"):
        BackendPool("not-a-url")
    pool = BackendPool()
    with pytest.raises(ConfigError, match="--sglang-url"):
        pool.get()
    with pytest.raises(ConfigError, match="ftp://x"):
        pool.get("ftp://x")
