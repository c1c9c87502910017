"""A whole rollout on a real 3-master Redis Cluster: scheduler, two evaluator workers and a
finalizer as processes (the engine's launcher, with a ``redis+cluster://`` URL), the
trainer's client requesting, waiting and loading. Nothing in the engine knows it is on a
cluster beyond the URL: the control plane shares one slot, the rollout streams spread. The
operator tools (status, pool, top, tail, retention) then run against the same cluster."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot

from engine.client import RolloutClient, collate
from engine.events import AdmissionClosed, EventLog, SampleCompleted
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.ops import cli
from engine.ops.processes import Processes
from tests.events.redis_cluster import RedisClusterProcs, cluster_fixture
from tests.rig import (
    EVALUATOR_CONFIG,
    assert_tokens_released_once,
    events_of,
    launcher,
    released_tokens,
    start_finalizer,
    start_worker,
)

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterProcs]:
    yield from cluster_fixture()


@pytest.fixture
async def cluster_log(redis_cluster: RedisClusterProcs) -> AsyncIterator[EventLog]:
    redis_cluster.flushall()
    log = RedisEventLog(connect(RedisSettings(url=redis_cluster.url, block_ms=200)),
                        producer="test", block_ms=200)
    yield log
    await log.aclose()


@pytest.fixture
def procs(redis_cluster: RedisClusterProcs, tmp_path: Path) -> Iterator[Processes]:
    with launcher(redis_cluster.url, tmp_path) as processes:
        yield processes


async def _cli(*argv: str) -> int:
    return await asyncio.to_thread(cli.main, list(argv))


async def test_rollouts_on_a_redis_cluster(
    cluster_log: EventLog, procs: Processes, redis_cluster: RedisClusterProcs, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    log = cluster_log
    data = tmp_path / "ds.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(40)))
    config = tmp_path / "rollout.yaml"
    config.write_text(
        "rollout:\n  defaults: {task_type: scripted}\n"
        f"  datasets:\n    ds: {{path: {data}, n_samples_per_prompt: 2}}\n"
    )
    layout = '{"node-a": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}'
    procs.start(
        "sched", "scheduler", "--rollout-config", str(config),
        "--evaluator-config", str(EVALUATOR_CONFIG), "--cluster-layout", layout,
        "--scheduler-id", "s1",
    )
    start_worker(procs, "w1")
    start_worker(procs, "w2")
    start_finalizer(procs)
    client = RolloutClient(log)
    rids = [await client.request(iteration=i, n_prompts=6, n_samples_per_prompt=2, seed=5)
            for i in range(4)]
    slots = {key_slot(log.names.rollout(rid).encode()) for rid in rids}
    assert len(slots) > 1  # the rollouts' streams are spread over the slots
    for rid in rids:
        ready = await client.wait_ready(rid, timeout=90)
        assert (ready.n_completed, ready.n_aborted, len(ready.sample_ids)) == (12, 0, 12)
        samples = await client.load(rid)
        assert [s.index for s in samples] == list(range(12))
        batch = collate(samples)
        assert batch["tokens"].shape == (12, 8)
        terminals = Counter(ev.sample_id for ev in
                            await events_of(log, log.names.rollout(rid), SampleCompleted))
        assert set(terminals.values()) == {1} and len(terminals) == 12
        assert_tokens_released_once(await released_tokens(log, rid))
    # The rollouts fetched consecutive, disjoint prompts (the cursor on rl:data held).
    prompts = [s.prompt for rid in rids for s in await client.load(rid)]
    assert len(set(prompts)) == 4 * 6
    pool = [e.event for e in await log.read_all(log.names.pool)]
    closed = [e.rollout_id for e in pool if isinstance(e, AdmissionClosed)]
    assert sorted(closed) == sorted(rids)
    # The keys really live on several masters.
    per_node = [int(redis_cluster.cli(p, "DBSIZE")) for p in redis_cluster.ports]
    assert sum(1 for n in per_node if n > 0) >= 2, per_node
    # The operator tools, pointed at the cluster.
    url = redis_cluster.url
    capsys.readouterr()
    assert await _cli("status", rids[0], "--redis-url", url) == 0
    assert await _cli("pool", "--redis-url", url) == 0
    assert await _cli("top", "--once", "--redis-url", url) == 0
    # a blocking read over the control plane and a rollout stream (two slots)
    assert await _cli("tail", "--from-start", "--count", "5", "--rollout", rids[1],
                      "--redis-url", url) == 0
    out = capsys.readouterr().out
    assert "1 node" in out and log.names.work("scripted") in out
    assert sum(1 for line in out.splitlines() if f"rollout={rids[1]}" in line) == 5
    assert await _cli("retention", "--store", str(tmp_path / "store"), "--keep-s", "0",
                      "--redis-url", url) == 0
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(
        f"{rid}.rollout" for rid in rids)
    assert await log.read_snapshot("pool") is not None
    procs.signal("sched", signal.SIGTERM)
    assert await asyncio.to_thread(procs.wait, "sched", 30) == 0
