"""Event throughput on a 3-master Redis Cluster beside one redis-server, same client code.

Two arms, each measured in interleaved rounds on both stores (a redis-server started here,
and a 3-master cluster started with ``redis-server --cluster-enabled yes`` x3 and
``redis-cli --cluster create``, as the tests do):

  rollout_events  ``EventLog.append_many`` of ``SampleCompleted`` events (``--tokens``
                  response tokens each) to ``--rollouts`` rollout streams, in pipelines of
                  500; on the cluster the streams spread over the masters
  admissions      ``append_if_last`` on the pool with a ``BatchAdmitted`` follow-up on a
                  work stream (the admission script), one after the other; on the
                  cluster all of them run on the control plane's master

Every process here shares one machine with the three masters, so the figures are floors set
by the client's CPU, not what a master can take; ``per_master`` is the cluster's rate over
the masters that hold rollout streams.

    python bench/cluster.py [--events 20000] [--tokens 256] [--rollouts 64] [--rounds 3]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bus import make_events  # noqa: E402
from engine.events import BatchAdmitted, TokenAcquired  # noqa: E402
from engine.events.redis_log import RedisEventLog, RedisSettings, connect  # noqa: E402
from engine.ops.embedded import start_redis  # noqa: E402
from tests.events.redis_cluster import start_cluster  # noqa: E402

CHUNK = 500


async def rollout_events(log: RedisEventLog, events: list[Any], rollouts: int, tag: str) -> float:
    names = log.names
    items = [(names.rollout(f"{tag}-{i % rollouts}"), ev) for i, ev in enumerate(events)]
    t0 = time.perf_counter()
    for i in range(0, len(items), CHUNK):
        await log.append_many(items[i : i + CHUNK])
    return len(items) / (time.perf_counter() - t0)


async def admissions(log: RedisEventLog, n: int, tag: str) -> float:
    names = log.names
    last = await log.last_id(names.pool)
    t0 = time.perf_counter()
    for i in range(n):
        acquired = TokenAcquired(rollout_id=tag, batch_id=f"b{i}", evaluator_id="math", tokens=[])
        admitted = BatchAdmitted(rollout_id=tag, batch_id=f"b{i}", evaluator_id="math",
                                 sample_ids=[f"s{i}"], token_ids=[])
        last = (await log.append_if_last(names.pool, acquired, last,
                                         also=[(names.work("math"), admitted)]))[0]
    return n / (time.perf_counter() - t0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    single = start_redis()
    cluster = start_cluster()
    try:
        logs = {
            "single": RedisEventLog(connect(RedisSettings(url=single.url)), producer="bench"),
            "cluster": RedisEventLog(connect(RedisSettings(url=cluster.url)), producer="bench"),
        }
        events = make_events(args.events, args.tokens)
        rates: dict[str, dict[str, list[float]]] = {
            k: {"rollout_events": [], "admissions": []} for k in logs
        }
        for r in range(args.rounds):
            for kind, log in logs.items():
                rates[kind]["rollout_events"].append(
                    await rollout_events(log, events, args.rollouts, f"r{r}"))
                rates[kind]["admissions"].append(await admissions(log, args.admissions, f"a{r}"))
        holding = sum(1 for p in cluster.ports if int(cluster.cli(p, "DBSIZE")) > 0)
        for log in logs.values():
            await log.aclose()
    finally:
        cluster.stop()
        single.stop()
    med = {k: {arm: statistics.median(v) for arm, v in arms.items()} for k, arms in rates.items()}
    return {
        "events": args.events,
        "tokens": args.tokens,
        "rollouts": args.rollouts,
        "rounds": args.rounds,
        "single_rollout_events_per_s": round(med["single"]["rollout_events"]),
        "cluster_rollout_events_per_s": round(med["cluster"]["rollout_events"]),
        "cluster_masters_holding_keys": holding,
        "cluster_rollout_events_per_s_per_master": round(
            med["cluster"]["rollout_events"] / max(1, holding)),
        "cluster_vs_single_rollout_events": round(
            med["cluster"]["rollout_events"] / med["single"]["rollout_events"], 3),
        "single_admissions_per_s": round(med["single"]["admissions"]),
        "cluster_admissions_per_s": round(med["cluster"]["admissions"]),
        "cluster_vs_single_admissions": round(
            med["cluster"]["admissions"] / med["single"]["admissions"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--admissions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
