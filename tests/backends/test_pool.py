"""``BackendPool``: a worker's backends, one per model endpoint, shared by its episodes and
closed when it stops. Generations go over real sockets to the tinylm server."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import httpx
import pytest

from engine.backends import BackendPool, ModelBackend, SGLangBackend, SGLangConfig
from engine.backends.pool import parse_urls
from engine.errors import BackendUnavailable, ConfigError
from tinylm.server import TinyLMServer, start_server

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
        assert url not in self.transports, f"{url} built twice"  # one backend per endpoint
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


# -- several policy servers --------------------------------------------------------------------


def test_urls_parse_from_lists_and_commas() -> None:
    assert parse_urls(["http://a:1, http://b:2/", "http://c:3", "http://a:1"]) == (
        "http://a:1",
        "http://b:2",
        "http://c:3",
    )
    assert parse_urls("http://a:1") == ("http://a:1",) and parse_urls(None) == ()
    with pytest.raises(ConfigError, match="nope"):
        parse_urls("http://a:1,nope")
    pool = BackendPool("http://a:1,http://b:2", build=Builds())
    assert pool.default_urls == ("http://a:1", "http://b:2") and pool.default_url == "http://a:1"


def test_a_trajectory_stays_on_the_server_it_was_first_given() -> None:
    urls = [f"http://policy-{i}:30000" for i in range(3)]
    pool = BackendPool(urls, build=Builds())
    views = [pool.bind(f"rollout/sample-{i}") for i in range(6)]
    first = [v.get() for v in views]
    # The least-loaded server takes each new trajectory: 6 over 3 servers is 2 each.
    assert pool.load() == dict.fromkeys(urls, 2)
    for _ in range(3):  # later turns: the same server, whatever the load is now
        assert [v.get() for v in views] == first
    assert {pool.server_of(v.key or "") for v in views} == set(urls)
    # An explicit endpoint is never balanced, and does not count as a trajectory.
    assert views[0].get("http://teacher:1") is pool.get("http://teacher:1")
    # Ended trajectories free their server: the next one goes where there is room.
    freed = pool.server_of("rollout/sample-0")
    views[0].release()
    views[0].release()  # releasing twice is harmless
    assert pool.load()[freed or ""] == 1
    newcomer = pool.bind("rollout/sample-6")
    newcomer.get()
    assert pool.server_of("rollout/sample-6") == freed


def test_ties_are_broken_by_the_key_not_by_the_order_of_the_list() -> None:
    urls = [f"http://policy-{i}:30000" for i in range(4)]
    keys = [f"k{i}" for i in range(64)]

    def first_choice(order: list[str]) -> list[str | None]:
        placed = []
        for key in keys:
            pool = BackendPool(order, build=Builds())  # an empty pool: every server ties
            pool.get(key=key)
            placed.append(pool.server_of(key))
        return placed

    forward = first_choice(urls)
    assert forward == first_choice(list(reversed(urls)))
    assert set(forward) == set(urls)  # and the keys spread over every server


async def test_bound_views_share_the_pools_backends(tinylm_server: TinyLMServer) -> None:
    pool = BackendPool([tinylm_server.url, "http://127.0.0.1:9"], build=Builds())
    view = pool.bind("r/s")
    backend = view.get()
    await view.aclose()  # a view only ends its trajectory
    assert pool.server_of("r/s") is None and pool.get(key="r/s") is not None
    await pool.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        view.get()
    assert backend is not None


async def test_trajectories_over_two_real_servers(tinylm_dir: Path) -> None:
    builds = Builds()
    params = {"max_new_tokens": 3, "temperature": 0.0}
    with start_server(tinylm_dir) as a, start_server(tinylm_dir) as b:
        steps = {a.url: a.scheduler.steps, b.url: b.scheduler.steps}
        async with BackendPool(f"{a.url},{b.url}", build=builds) as pool:
            views = [pool.bind(f"r/{i}") for i in range(4)]

            async def episode(view: BackendPool) -> set[str]:
                used = set()
                for _ in range(3):  # three turns
                    backend = view.get()
                    await backend.generate(input_ids=PROMPT, sampling_params=params)
                    used.add(backend.base_url)
                return used

            used = await asyncio.gather(*(episode(v) for v in views))
            assert all(len(u) == 1 for u in used)  # each trajectory on one server
            assert sorted(u.pop() for u in used) == sorted([a.url, a.url, b.url, b.url])
        counts = {url: t.requests for url, t in builds.transports.items()}
        assert counts == {a.url: 6, b.url: 6}
        assert a.scheduler.steps > steps[a.url] and b.scheduler.steps > steps[b.url]


def test_the_worker_takes_several_servers() -> None:
    from engine.settings import Settings
    from workers.evaluator import FLAGS, build_parser, policy_urls

    parser = build_parser(Settings())

    def urls(argv: list[str], env: Settings) -> tuple[list[str], argparse.Namespace]:
        args = parser.parse_args(argv)
        return policy_urls(args, FLAGS.apply(env, args)), args

    got, args = urls(["--sglang-url", "http://a:1,http://b:2", "--sglang-url", "http://c:3"],
                     Settings())
    assert got == ["http://a:1", "http://b:2", "http://c:3"]
    assert args.sglang_url is None  # agents leave the choice to the pool
    got, one = urls(["--sglang-url", "http://a:1/"], Settings())
    assert got == ["http://a:1"] and one.sglang_url == "http://a:1"
    got, _ = urls([], Settings(sglang_url="http://x:1, http://y:2"))
    assert got == ["http://x:1", "http://y:2"]
