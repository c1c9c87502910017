"""The EventLog contract suite (tests/events/test_log_contract.py) on a real 3-master Redis
Cluster, plus what only a cluster shows: streams spread over the masters, a blocking read
over several slots, and the single-slot rule of the atomic steps."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from engine.events import RolloutFailed, StreamNames
from engine.events.names import key_slot
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from tests.conftest import ClientFactory, LogFactory
from tests.events.redis_cluster import RedisClusterProcs, cluster_fixture
from tests.events.test_log_contract import *  # noqa: F403  (the suite, collected here too)
from tests.events.test_log_contract import failed


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    yield from cluster_fixture()


@pytest.fixture
async def redis_factory(redis_cluster: RedisClusterProcs) -> AsyncIterator[ClientFactory]:
    """Overrides the conftest factory: clients of one fresh, empty cluster."""
    redis_cluster.flushall()
    settings = RedisSettings(url=redis_cluster.url, block_ms=500)
    # Connected ahead: a cluster client's first command discovers the slots, which on a
    # loaded machine can outlast the 100 ms idle windows some contract tests use.
    ready = [connect(settings) for _ in range(8)]
    for client in ready:
        await client.initialize()
    clients = list(ready)

    def make():  # type: ignore[no-untyped-def]
        if ready:
            return ready.pop(0)
        client = connect(settings)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
def log_backend() -> str:
    return "redis-cluster"


@pytest.fixture
def make_log(redis_factory: ClientFactory) -> LogFactory:
    """Overrides the conftest factory: logs on the cluster only."""
    return lambda **kwargs: RedisEventLog(redis_factory(), **kwargs)


def test_cluster_urls_select_the_cluster_client() -> None:
    assert RedisSettings(url="redis+cluster://127.0.0.1:7000").is_cluster
    assert RedisSettings(url="redis://127.0.0.1:7000/0", cluster=True).is_cluster
    assert not RedisSettings(url="redis://127.0.0.1:7000/0").is_cluster
    tls = RedisSettings(url="rediss+cluster://h:1", tls_ca_file="/ca.crt")
    assert tls.tls and tls.client_url == "rediss://h:1"
    with pytest.raises(Exception, match="only database 0"):
        RedisSettings(url="redis+cluster://127.0.0.1:7000/3")


def test_control_plane_shares_a_slot_and_rollouts_spread() -> None:
    names = StreamNames()
    plane = [names.control, names.pool, names.data, names.capture, names.dead,
             names.dead_seen, names.work("math"), names.work("code"),
             names.snapshot("pool"), names.counter("x")]
    assert len({key_slot(k) for k in plane}) == 1
    rollouts = {key_slot(names.rollout(f"r{i}")) for i in range(50)}
    assert len(rollouts) > 40


async def test_rollout_streams_land_on_every_master(
    log: RedisEventLog, redis_cluster: RedisClusterProcs
) -> None:
    names = StreamNames()
    await log.append_many([(names.rollout(f"r{i}"), failed(i)) for i in range(30)])
    per_node = [int(redis_cluster.cli(p, "DBSIZE")) for p in redis_cluster.ports]
    assert sum(per_node) == 30
    assert all(n > 0 for n in per_node), per_node


async def test_a_blocking_read_spans_slots(log: RedisEventLog) -> None:
    names = StreamNames()
    streams = [names.control, *(names.rollout(f"r{i}") for i in range(6))]
    assert len({key_slot(s) for s in streams}) > 1
    ids = await log.append_many([(s, RolloutFailed(rollout_id=s, reason="x")) for s in streams])
    raw = await log.tail_raw({s: "0-0" for s in streams}, block_ms=50)
    assert sorted((s, i) for s, i, _ in raw) == sorted(zip(streams, ids, strict=True))
    envs = await log.tail({s: "0-0" for s in streams}, block_ms=50)
    assert sorted(e.stream for e in envs) == sorted(streams)
    assert await log.tail_raw(dict(zip(streams, ids, strict=True)), block_ms=20) == []


def test_the_cluster_fixture_skips_without_binaries_and_fails_in_ci(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server, no redis-cli
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="redis-server and redis-cli not installed"):
        next(cluster_fixture())
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="missing in CI"):
        next(cluster_fixture())
