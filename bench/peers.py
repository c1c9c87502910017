"""The same rollout through this engine, through Ray actors and through an rq job queue.

One workload, three ways of dispatching it (issue 16, point 4). ``--samples`` samples of
``bench/rollout_evaluators.py``'s agent, in batches of 256 (8 samples per prompt), on
``--workers`` worker processes that each run up to 8 batches at once, once with the
zero-latency agent and once with an agent whose ``run`` sleeps ``--slow-ms`` (50 ms) first:

* ``engine``: bench/rollout.py's arm -- a redis-server, the scheduler, the evaluator workers
  and a finalizer as processes; the trainer requests and gets the samples with
  ``client.wait_load`` (the ready event and the samples, the stream folded while it is
  written, as ``RefillLoop`` does). Every event is in Redis before it counts.
* ``ray``: the slime / verl shape. ``ray.init`` on this machine; one async Ray actor per
  worker (``max_concurrency`` 8); the driver splits the tasks into batches, sends each batch
  as one actor call, round robin, and gathers the returned ``Sample`` lists with
  ``ray.get``. Nothing is durable: the results live in the actor until the driver has them.
* ``rq``: a Redis job queue. One job per batch (its tasks pickled into Redis), ``rq`` workers
  as processes (the stock forking ``Worker``: a work horse per job), the result pickled back
  into Redis; the driver waits for each job's result.

Per arm and agent: samples/s from the first dispatch to every sample in the driver's
hands (for the engine: request -> ``wait_load`` done; beside it, from a second rollout of
the same size, ``sequential_samples_per_s`` (``wait_ready`` then ``load``, one after the
other), ``ready_samples_per_s`` (request -> ready) and ``load_s``), and CPU per sample: the
user + system time, read from ``/proc``, of everything that is not the store -- the driver
(this process), the workers, and for the engine its scheduler and finalizer. The store's
CPU is reported beside it
(redis-server for the engine and rq; Ray's own daemons -- gcs_server, raylet and the other
processes ``ray.init`` starts -- for Ray).

Kill test (the ``--slow-ms`` agent, so batches are in flight): a second rollout of each arm
SIGKILLs one worker process at 40 % of the arm's measured wall time and reports what the
rollout lost: ``samples_lost`` (never delivered to the driver), ``samples_rerun`` (ran
again elsewhere) and ``completed`` (whether the rollout finished at all). The engine runs
this with a 3 s claim window (``--claim-idle-ms 3000``) so the survivor claims the dead
worker's batches quickly; Ray and rq run with their defaults (no actor restarts or task
retries, no job retry), the way rollout layers built on them run.

The last line printed is one JSON object with ``engine_vs_ray_ratio`` (engine samples/s
over Ray's, zero-latency agent) and the loss figures.

    pip install -e '.[peers]'   # ray and rq; optional, never needed by the engine
    python bench/peers.py [--samples 20000] [--workers 2] [--arms engine,ray,rq]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rollout import (  # noqa: E402
    PER_PROMPT,
    EngineArm,
    cpu_of,
    cpu_seconds,
    cpu_with_children,
    descendants,
    episode_sample,
)
from bench.rollout_evaluators import BATCH_SIZE, ZeroLatencyAgent  # noqa: E402
from engine.domain import Task  # noqa: E402
from engine.ops.embedded import start_redis_server  # noqa: E402
from engine.sample import Sample  # noqa: E402

MAX_BATCHES = 8  # batches one worker runs at once, in every arm
KILL_AT = 0.4  # the kill lands at this fraction of the arm's measured wall time
KILL_TIMINGS = {"heartbeat_ms": 500, "claim_idle_ms": 3000, "block_ms": 500}


# ---------------------------------------------------------------------- the workload


def make_tasks(n_samples: int, rollout_id: str) -> list[Task]:
    return [
        Task(sample_id=f"{rollout_id}-{i}", rollout_id=rollout_id, index=i,
             group_index=i // PER_PROMPT, prompt=f"q{i // PER_PROMPT}", label=str(i),
             dataset_name="bench", task_type="fast", source_line=1)
        for i in range(n_samples)
    ]


def batches(tasks: Sequence[Task]) -> list[list[Task]]:
    return [list(tasks[i : i + BATCH_SIZE]) for i in range(0, len(tasks), BATCH_SIZE)]


async def run_batch(agent: ZeroLatencyAgent, tasks: Sequence[Task]) -> list[Sample]:
    """One batch the way a worker of the seeds runs it: init -> run -> eval -> cleanup per
    sample, all of the batch's samples at once, a ``Sample`` per task."""
    return list(await asyncio.gather(*(episode_sample(agent, t) for t in tasks)))


# ---------------------------------------------------------------------- figures


def figures(n: int, wall: float, cpu: float, store_cpu: float, **extra: Any) -> dict[str, Any]:
    return {
        "samples_per_s": round(n / wall, 1),
        "cpu_ms_per_sample": round(1000 * cpu / n, 4),
        "store_cpu_ms_per_sample": round(1000 * store_cpu / n, 4),
        "wall_s": round(wall, 3),
        **extra,
    }


# ---------------------------------------------------------------------- engine


class _EngineArgs(argparse.Namespace):
    def __init__(self, samples: int, workers: int) -> None:
        super().__init__(samples=samples, workers=workers, max_batches=MAX_BATCHES,
                         play_scheduler=False)


async def engine_arm(n: int, workers: int, latency_ms: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        arm = EngineArm(_EngineArgs(n, workers), Path(tmp),
                        env={"BENCH_AGENT_LATENCY_MS": str(latency_ms)})
        arm.iter_load = False  # the driver loads once, as the other arms receive once
        arm.start()
        try:
            await arm.rollout(max(PER_PROMPT * 64, n // 10))  # warm-up
            # request -> ready, then load: the rates of the two steps apart
            seq = await arm.rollout(n)
            # wait_load, the trainer's way (RefillLoop): the load overlaps the rollout
            drv0 = time.process_time()
            r = await arm.rollout(n, overlap=True)
            driver = time.process_time() - drv0
        finally:
            await arm.close()
    cpu = (r["engine_cpu_ms_per_sample"] * n / 1000) + driver
    return figures(
        n, r["wall_s"], cpu, r["redis_cpu_ms_per_sample"] * n / 1000,
        engine_cpu_ms_per_sample=round(r["engine_cpu_ms_per_sample"], 4),
        sequential_samples_per_s=round(n / (seq["wall_s"] + seq["load_s"]), 1),
        ready_samples_per_s=round(seq["samples_per_s"], 1),
        load_s=round(seq["load_s"], 3),
    )


async def engine_kill(n: int, workers: int, latency_ms: float, kill_after: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        arm = EngineArm(_EngineArgs(n, workers), Path(tmp),
                        env={"BENCH_AGENT_LATENCY_MS": str(latency_ms)}, timings=KILL_TIMINGS)
        arm.start()
        try:
            await arm.rollout(max(PER_PROMPT * 64, n // 10))  # warm-up (and a client)
            client = arm.client
            assert client is not None
            t0 = time.perf_counter()
            rid = await client.request(
                iteration=99, n_prompts=n // PER_PROMPT, n_samples_per_prompt=PER_PROMPT,
                seed=99, rollout_id="bench-kill",
            )
            await asyncio.sleep(kill_after)
            arm.procs.signal("worker0", signal.SIGKILL)
            completed = True
            try:
                await client.wait_ready(rid, timeout=300)
                samples = await client.load(rid)
            except Exception:
                completed, samples = False, []
            wall = time.perf_counter() - t0
        finally:
            await arm.close()
    ok = [s for s in samples if not s.remove_sample]
    rerun = sum(1 for s in ok if int(s.metadata.get("attempt", 1)) > 1)  # type: ignore[arg-type]
    return {
        "completed": completed and len(ok) == n,
        "samples_delivered": len(ok),
        "samples_lost": n - len(ok),
        "samples_rerun": rerun,
        "wall_s": round(wall, 3),
    }


# ---------------------------------------------------------------------- Ray


def _ray_actor_class() -> Any:
    import ray

    @ray.remote(num_cpus=1, max_concurrency=MAX_BATCHES)
    class RolloutActor:
        def __init__(self, latency_s: float) -> None:
            self.agent = ZeroLatencyAgent(latency_s)

        async def pid(self) -> int:
            return os.getpid()

        async def run_batch(self, tasks: list[Task]) -> list[Sample]:
            return await run_batch(self.agent, tasks)

    return RolloutActor


class RayArm:
    def __init__(self, workers: int) -> None:
        import ray

        self.ray = ray
        os.environ["PYTHONPATH"] = str(ROOT)  # the actors import bench/ and engine/
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
        self.actor_cls = _ray_actor_class()
        self.workers = workers

    def system_pids(self) -> set[int]:
        """Ray's own processes: what ``ray.init`` started (gcs_server, raylet, ...) and
        every process below them (the raylet's idle workers)."""
        pids = descendants(os.getpid())
        node = getattr(self.ray._private.worker, "_global_node", None)
        for infos in (getattr(node, "all_processes", None) or {}).values():
            for info in infos:
                pid = getattr(getattr(info, "process", None), "pid", None)
                if pid:
                    pids |= {pid} | descendants(pid)
        return pids

    def start(self, latency_ms: float) -> tuple[list[Any], list[int]]:
        actors = [self.actor_cls.remote(latency_ms / 1000) for _ in range(self.workers)]
        pids = self.ray.get([a.pid.remote() for a in actors])
        return actors, pids

    def submit(self, actors: list[Any], tasks: list[Task]) -> list[tuple[Any, int]]:
        return [
            (actors[i % len(actors)].run_batch.remote(batch), len(batch))
            for i, batch in enumerate(batches(tasks))
        ]

    def measure(self, n: int, latency_ms: float) -> dict[str, Any]:
        actors, pids = self.start(latency_ms)
        try:
            self.ray.get([r for r, _ in self.submit(actors, make_tasks(512, "warm"))])
            tasks = make_tasks(n, "ray")
            system = self.system_pids() - set(pids)
            drv0, act0, sys0 = time.process_time(), cpu_of(pids), cpu_of(system)
            t0 = time.perf_counter()
            out = self.ray.get([r for r, _ in self.submit(actors, tasks)])
            wall = time.perf_counter() - t0
            cpu = time.process_time() - drv0 + cpu_of(pids) - act0
            sys_cpu = cpu_of(system) - sys0
            assert sum(len(o) for o in out) == n
        finally:
            for a in actors:
                self.ray.kill(a)
        return figures(n, wall, cpu, sys_cpu)

    def kill(self, n: int, latency_ms: float, kill_after: float) -> dict[str, Any]:
        actors, pids = self.start(latency_ms)
        refs = self.submit(actors, make_tasks(n, "ray-kill"))
        t0 = time.perf_counter()
        time.sleep(kill_after)
        os.kill(pids[0], signal.SIGKILL)
        delivered = lost = 0
        for ref, size in refs:
            try:
                delivered += len(self.ray.get(ref, timeout=300))
            except self.ray.exceptions.RayError:
                lost += size
        wall = time.perf_counter() - t0
        for a in actors:
            self.ray.kill(a)
        return {
            "completed": lost == 0,
            "samples_delivered": delivered,
            "samples_lost": lost,
            "samples_rerun": 0,
            "wall_s": round(wall, 3),
        }

    def close(self) -> None:
        self.ray.shutdown()


# ---------------------------------------------------------------------- rq

_RQ_QUEUE = "peers"


def rq_batch(tasks: list[Task], latency_s: float) -> list[Sample]:
    """The rq job: one batch (imported by name in the rq worker)."""
    return asyncio.run(run_batch(ZeroLatencyAgent(latency_s), tasks))


def rq_worker_main(url: str) -> None:
    from redis import Redis
    from rq import Worker

    Worker([_RQ_QUEUE], connection=Redis.from_url(url)).work(logging_level="ERROR")


class RqArm:
    def __init__(self, workers: int, tmp: Path) -> None:
        from redis import Redis
        from rq import Queue

        self.redis = start_redis_server()
        self.conn = Redis.from_url(self.redis.url)
        self.queue = Queue(_RQ_QUEUE, connection=self.conn)
        self.tmp = tmp
        self.n_workers = workers
        self.procs: list[subprocess.Popen[bytes]] = []

    def start_workers(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for w in range(self.n_workers):
            self.procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--rq-worker", self.redis.url],
                cwd=ROOT, env=env, start_new_session=True,  # the worker and its horses
                stdout=open(self.tmp / f"rq{w}.log", "wb"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
            ))

    def stop_workers(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        self.procs = []
        self.conn.flushall()

    def submit(self, tasks: list[Task], latency_ms: float) -> list[tuple[Any, int]]:
        return [
            (self.queue.enqueue("bench.peers.rq_batch", batch, latency_ms / 1000,
                                job_timeout=600), len(batch))
            for batch in batches(tasks)
        ]

    def gather(self, jobs: list[tuple[Any, int]], deadline: float) -> tuple[int, int, list[Any]]:
        delivered = lost = 0
        out: list[Any] = []
        from redis.exceptions import TimeoutError as RedisTimeout

        for job, size in jobs:
            result = None
            while result is None and time.perf_counter() < deadline:
                left = max(1, min(5, int(deadline - time.perf_counter())))
                try:  # a blocking read of the job's result stream
                    result = job.latest_result(timeout=left)
                except RedisTimeout:
                    pass
            if result is None:  # past the deadline: what is there now
                result = job.latest_result()
            if result is not None and result.type == result.Type.SUCCESSFUL:
                out.append(result.return_value)
                delivered += len(result.return_value)
            else:
                lost += size
        return delivered, lost, out

    def measure(self, n: int, latency_ms: float) -> dict[str, Any]:
        self.start_workers()
        try:
            self.gather(self.submit(make_tasks(512, "warm"), latency_ms), time.perf_counter() + 120)
            pids = [p.pid for p in self.procs]
            redis_pid = self.redis._proc.pid if self.redis._proc is not None else None
            drv0, w0 = time.process_time(), sum(cpu_with_children(p) for p in pids)
            r0 = cpu_seconds(redis_pid) if redis_pid else 0.0
            t0 = time.perf_counter()
            delivered, lost, _ = self.gather(self.submit(make_tasks(n, "rq"), latency_ms),
                                             time.perf_counter() + 600)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - drv0 + sum(cpu_with_children(p) for p in pids) - w0
            redis_cpu = (cpu_seconds(redis_pid) if redis_pid else 0.0) - r0
            assert delivered == n and lost == 0, (delivered, lost)
        finally:
            self.stop_workers()
        return figures(n, wall, cpu, redis_cpu)

    def kill(self, n: int, latency_ms: float, kill_after: float, wait_s: float) -> dict[str, Any]:
        self.start_workers()
        try:
            self.gather(self.submit(make_tasks(512, "warm"), latency_ms), time.perf_counter() + 120)
            t0 = time.perf_counter()
            jobs = self.submit(make_tasks(n, "rq-kill"), latency_ms)
            time.sleep(kill_after)
            while not (horses := descendants(self.procs[0].pid)):  # a horse runs a job
                time.sleep(0.001)
            for pid in (self.procs[0].pid, *horses):  # the worker and its work horse (the
                os.kill(pid, signal.SIGKILL)  # horse runs in a session of its own)
            delivered, lost, _ = self.gather(jobs, time.perf_counter() + wait_s)
            wall = time.perf_counter() - t0
            stuck = [j.get_status() for j, _ in jobs if j.get_status() != "finished"]
        finally:
            self.stop_workers()
        return {
            "completed": lost == 0,
            "samples_delivered": delivered,
            "samples_lost": lost,
            "samples_rerun": 0,
            "wall_s": round(wall, 3),
            "unfinished_job_states": sorted({str(s) for s in stuck}),
            "waited_s": wait_s,
        }

    def close(self) -> None:
        self.conn.close()
        self.redis.stop()


# ---------------------------------------------------------------------- main


def _log(msg: str) -> None:
    print(msg, flush=True)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    arms = set(args.arms.split(","))
    latencies = {"zero": 0.0, f"{args.slow_ms:g}ms": args.slow_ms}
    n, w = args.samples, args.workers
    results: dict[str, dict[str, Any]] = {}
    losses: dict[str, dict[str, Any]] = {}

    def record(arm: str, key: str, fn: Callable[[], dict[str, Any]]) -> None:
        res = fn()
        results.setdefault(arm, {})[key] = res
        _log(f"{arm} {key}: {json.dumps(res)}")

    if "engine" in arms:
        for key, lat in latencies.items():
            record("engine", key, lambda lat=lat: asyncio.run(engine_arm(n, w, lat)))
        slow = results["engine"][f"{args.slow_ms:g}ms"]
        after = KILL_AT * n / slow["ready_samples_per_s"]  # while samples still run
        losses["engine"] = asyncio.run(engine_kill(n, w, args.slow_ms, after))
        _log(f"engine kill: {json.dumps(losses['engine'])}")
    if "ray" in arms:
        ray_arm = RayArm(w)
        try:
            for key, lat in latencies.items():
                record("ray", key, lambda lat=lat: ray_arm.measure(n, lat))
            after = KILL_AT * results["ray"][f"{args.slow_ms:g}ms"]["wall_s"]
            losses["ray"] = ray_arm.kill(n, args.slow_ms, after)
            _log(f"ray kill: {json.dumps(losses['ray'])}")
        finally:
            ray_arm.close()
    if "rq" in arms:
        with tempfile.TemporaryDirectory(prefix="bench-peers-rq-") as tmp:
            rq_arm = RqArm(w, Path(tmp))
            try:
                for key, lat in latencies.items():
                    record("rq", key, lambda lat=lat: rq_arm.measure(n, lat))
                wall = results["rq"][f"{args.slow_ms:g}ms"]["wall_s"]
                losses["rq"] = rq_arm.kill(n, args.slow_ms, KILL_AT * wall,
                                           wait_s=max(30.0, 5 * wall))
                _log(f"rq kill: {json.dumps(losses['rq'])}")
            finally:
                rq_arm.close()

    def ratio(key: str) -> float | None:
        if "engine" in results and "ray" in results:
            return round(results["engine"][key]["samples_per_s"]
                         / results["ray"][key]["samples_per_s"], 4)
        return None

    return {
        "samples": n,
        "workers": w,
        "batch_size": BATCH_SIZE,
        "max_batches_per_worker": MAX_BATCHES,
        "results": results,
        "kill": losses,
        "engine_vs_ray_ratio": ratio("zero"),
        f"engine_vs_ray_ratio_{args.slow_ms:g}ms": ratio(f"{args.slow_ms:g}ms"),
        "engine_vs_rq_ratio": (
            round(results["engine"]["zero"]["samples_per_s"]
                  / results["rq"]["zero"]["samples_per_s"], 4)
            if "engine" in results and "rq" in results else None
        ),
        "samples_lost": {k: v["samples_lost"] for k, v in losses.items()},
        "samples_rerun": {k: v["samples_rerun"] for k, v in losses.items()},
        "rollout_completed": {k: v["completed"] for k, v in losses.items()},
        "target_engine_vs_ray_ratio": 0.5,
    }


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--rq-worker":
        rq_worker_main(sys.argv[2])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--arms", default="engine,ray,rq")
    args = parser.parse_args()
    if args.samples % PER_PROMPT:
        parser.error(f"--samples must be a multiple of {PER_PROMPT}")
    unknown = set(args.arms.split(",")) - {"engine", "ray", "rq"}
    if unknown:
        parser.error(f"--arms: unknown arm(s) {sorted(unknown)} (known: engine, ray, rq)")
    print(json.dumps(run_all(args)))


if __name__ == "__main__":
    main()
