"""Scheduler throughput: admission decisions/s and scheduling cost per sample.

Arms (a real redis-server started by the bench, via engine.ops.embedded.start_redis):
  pure        try_acquire_batch + folding the TokenAcquired, on a 64-node pool (no I/O)
  log         PoolGate.admit: the same decisions written with compare-and-append
              (TokenAcquired on rl:pool + BatchAdmitted on the work stream, one Lua call)
  race        three PoolGates (three clients) admitting at once: conflicts are retried
  per-sample  one RolloutRequested -> plan written (cursor + TaskFetched + BatchSealed +
              RolloutPlanned, chunked compare-and-appends) -> every batch admitted
              (TokenAcquired + BatchAdmitted), at 1k, 10k and 100k samples; engine CPU
              (this process) and wall time per sample. The flatness ratio divides the
              per-sample CPU cost at 100k by the one at 1k (target <= 1.3). It runs
              with the scheduler process's garbage-collector thresholds
              (workers.scheduler.tune_gc); --compare-default-gc measures the smallest and
              largest sizes again with Python's default thresholds.

The pool of the per-sample arm is large enough to hold every token at once (fractional GPU
and CPU shares on 64 nodes), so admission never waits for releases: what is measured is the
scheduler's own work, not an evaluator's.

    python bench/schedule.py [--sizes 1000,10000,100000] [--admissions 2000] [--rounds 3]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine.actors.admission import PoolGate, decide_admission
from engine.actors.planning import Planner
from engine.actors.scheduler import Scheduler, SchedulerConfig, declaration_for
from engine.config.layout import ClusterLayout, NodeSpec
from engine.config.rollout import RolloutConfig
from engine.domain import DatasetEntry, EvaluatorProfile, Resource
from engine.events import BatchSealed, Envelope, RolloutRequested
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.ops.embedded import start_redis
from engine.projections.placement import PoolProjection, pool_of
from workers.scheduler import GC_THRESHOLDS, tune_gc

SAMPLES_PER_PROMPT = 4
BATCH_SIZE = 8


def cluster(nodes: int) -> ClusterLayout:
    return ClusterLayout(
        nodes=tuple(
            NodeSpec(name=f"node-{i:02d}", gpus=tuple(range(8)), cpu=2000.0, memory_gb=2000.0)
            for i in range(nodes)
        )
    )


def spec() -> EvaluatorProfile:
    # 200 samples per GPU: 64 nodes x 8 GPUs hold 102,400 tokens at once.
    per = Resource(gpu=0.005, cpu=0.01, memory_gb=0.01)
    return EvaluatorProfile(
        evaluator_id="bench",
        resource=Resource(gpu=0.04, cpu=0.08, memory_gb=0.08, concurrency=BATCH_SIZE),
        run_resource=per,
        batch_size=BATCH_SIZE,
    )


def batches(n: int, rollout: str = "adm") -> list[BatchSealed]:
    return [
        BatchSealed(
            rollout_id=rollout,
            batch_id=f"{rollout}:b{i}",
            seq=i,
            evaluator_id="bench",
            sample_ids=[f"{rollout}:s{i * BATCH_SIZE + k}" for k in range(BATCH_SIZE)],
        )
        for i in range(n)
    ]


def pure_rate(nodes: int, n: int) -> float:
    s = spec()
    projection = PoolProjection()
    state = pool_of(declaration_for(cluster(nodes)))
    work = batches(n)
    t0 = time.perf_counter()
    for i, batch in enumerate(work):
        decision = decide_admission(state, batch, s)
        assert decision is not None
        state = projection.evolve(state, Envelope("rl:pool", f"1-{i}", decision.acquired))
    return n / (time.perf_counter() - t0)


async def log_rate(url: str, nodes: int, n: int, gates: int) -> tuple[float, int]:
    clients = [connect(RedisSettings(url=url)) for _ in range(gates)]
    await clients[0].flushall()
    logs = [RedisEventLog(c, producer=f"bench-{i}") for i, c in enumerate(clients)]
    await logs[0].append(logs[0].names.pool, declaration_for(cluster(nodes)))
    pool_gates = [PoolGate(log) for log in logs]
    for gate in pool_gates:
        await gate.refresh()
    s = spec()
    work = batches(n)

    async def admit(gate: PoolGate, mine: list[BatchSealed]) -> None:
        for batch in mine:
            assert await gate.admit(batch, s) is not None

    t0 = time.perf_counter()
    await asyncio.gather(*(admit(g, work[i::gates]) for i, g in enumerate(pool_gates)))
    elapsed = time.perf_counter() - t0
    conflicts = sum(g.conflicts for g in pool_gates)
    for c in clients:
        await c.aclose()
    return n / elapsed, conflicts


def write_dataset(directory: Path, prompts: int) -> Path:
    path = directory / "bench.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": f"Solve problem number {i}.", "label": str(i)}) + "\n")
    return path


async def per_sample_cost(
    url: str, planner: Planner, nodes: int, samples: int, chunk: int
) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per sample from request to the last BatchAdmitted."""
    client = connect(RedisSettings(url=url))
    await client.flushall()
    log = RedisEventLog(client, producer="bench")
    scheduler = Scheduler(
        log,
        planner=planner,
        layout=cluster(nodes),
        config=SchedulerConfig(scheduler_id="bench", plan_chunk=chunk),
    )
    await scheduler.start()
    request = RolloutRequested(
        rollout_id=f"r{samples}", n_prompts=samples // SAMPLES_PER_PROMPT, seed=1
    )
    entry = await log.append(log.names.control, request)
    env = Envelope(log.names.control, entry, request)
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    await scheduler.handle(env, request)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    admitted = await log.stream_length(log.names.work("bench"))
    expected = -(-samples // BATCH_SIZE)
    assert admitted == expected, f"{admitted} batches admitted, expected {expected}"
    await client.aclose()
    return cpu / samples, wall / samples


async def cost_at(
    url: str, planner: Planner, args: argparse.Namespace, size: int
) -> tuple[float, float]:
    rounds = max(1, args.rounds if size <= 10_000 else args.rounds_large)
    runs = [await per_sample_cost(url, planner, args.nodes, size, args.chunk)
            for _ in range(rounds)]
    cpu = statistics.median(r[0] for r in runs)
    wall = statistics.median(r[1] for r in runs)
    print(f"{size:>7} samples: engine CPU {cpu * 1e6:7.1f} us/sample, "
          f"wall {wall * 1e6:7.1f} us/sample ({rounds} rounds)")
    return cpu, wall


async def run(args: argparse.Namespace) -> dict[str, object]:
    sizes = [int(s) for s in args.sizes.split(",")]
    server = start_redis()
    out: dict[str, object] = {"redis": server.kind, "nodes": args.nodes}
    default_gc = gc.get_threshold()
    tune_gc()  # every arm runs as the scheduler process does, but the default-gc comparison
    try:
        pure = statistics.median(pure_rate(args.nodes, args.admissions) for _ in range(args.rounds))
        through_log = [await log_rate(server.url, args.nodes, args.admissions, 1)
                       for _ in range(args.rounds)]
        raced = [await log_rate(server.url, args.nodes, args.admissions, 3)
                 for _ in range(args.rounds)]
        out["pure_admission_decisions_per_s"] = round(pure)
        out["admissions_per_s"] = round(statistics.median(r for r, _ in through_log))
        out["admissions_per_s_3_racing_gates"] = round(statistics.median(r for r, _ in raced))
        out["race_conflicts_per_admission"] = round(
            statistics.median(c for _, c in raced) / args.admissions, 3
        )
        print(f"admission decisions/s, pure allocator ({args.nodes} nodes): {pure:,.0f}")
        print(f"admissions/s through the log (CAS, 1 gate): {out['admissions_per_s']:,}")
        print(f"admissions/s, 3 racing gates: {out['admissions_per_s_3_racing_gates']:,} "
              f"({out['race_conflicts_per_admission']} conflicts per admission)")

        with tempfile.TemporaryDirectory(prefix="bench-schedule-") as tmp:
            data = write_dataset(Path(tmp), max(sizes) // SAMPLES_PER_PROMPT)
            config = RolloutConfig(
                datasets=(
                    DatasetEntry(name="bench", path=data, task_type="bench",
                                 n_samples_per_prompt=SAMPLES_PER_PROMPT),
                )
            )
            planner = Planner(config, {"bench": spec()})
            # Warm-up: reads and shuffles the dataset once, outside every measurement.
            await per_sample_cost(server.url, planner, args.nodes, 64, args.chunk)
            costs: dict[int, tuple[float, float]] = {}
            for size in sizes:
                costs[size] = await cost_at(server.url, planner, args, size)
                out[f"cpu_us_per_sample_{size}"] = round(costs[size][0] * 1e6, 1)
                out[f"wall_us_per_sample_{size}"] = round(costs[size][1] * 1e6, 1)
            small, large = min(sizes), max(sizes)
            tag = f"{large // 1000}k_vs_{small // 1000}k"
            ratio = costs[large][0] / costs[small][0]
            wall_ratio = costs[large][1] / costs[small][1]
            out[f"per_sample_cost_ratio_{tag}"] = round(ratio, 3)
            out[f"per_sample_wall_ratio_{tag}"] = round(wall_ratio, 3)
            out["gc_thresholds"] = list(GC_THRESHOLDS)
            print(f"per-sample cost {large:,} vs {small:,}: CPU x{ratio:.2f}, "
                  f"wall x{wall_ratio:.2f} (gc thresholds {GC_THRESHOLDS})")
            if args.compare_default_gc:
                gc.set_threshold(*default_gc)
                print(f"again with Python's default gc thresholds {default_gc}:")
                base = {size: await cost_at(server.url, planner, args, size)
                        for size in (small, large)}
                default_ratio = base[large][0] / base[small][0]
                out[f"per_sample_cost_ratio_{tag}_default_gc"] = round(default_ratio, 3)
                print(f"per-sample cost {large:,} vs {small:,} (default gc): "
                      f"CPU x{default_ratio:.2f}")
    finally:
        gc.set_threshold(*default_gc)
        server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--admissions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rounds-large", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=4096, help="plan events per append")
    parser.add_argument("--compare-default-gc", action="store_true",
                        help="also measure the smallest and largest size with Python's "
                        "default gc thresholds (after the other runs, so noisier)")
    out = asyncio.run(run(parser.parse_args()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
