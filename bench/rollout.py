"""Rollout throughput through the full event path, beside the seeds' in-process loop.

Engine arm: a real redis-server, one scheduler process (``workers.scheduler``; when it is not
installed, the tests' scheduler player in this process), two evaluator worker processes and
one finalizer process. The trainer (this process) requests a rollout of ``--samples``
samples of a zero-latency agent (``bench/rollout_evaluators.py``) and waits for
``RolloutReady``: samples/s is samples / (request -> ready). Engine CPU is the user+system
time the scheduler, worker and finalizer processes spent during that window, read from
``/proc/<pid>/stat`` (redis-server's own CPU is reported beside it, not included).

In-process arm (the seeds' architecture): the same agent driven by one asyncio loop in this
process -- per sample a semaphore, init -> run -> eval -> cleanup and
``Sample.from_agent_result`` -- over the same number of samples.

Rounds alternate the arms; medians are reported. The last line printed is one JSON object.

    python bench/rollout.py [--samples 20000] [--rounds 3] [--workers 2]
    python bench/rollout.py --scaling 10000,100000   # per-sample cost by rollout size
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rollout_evaluators import BATCH_SIZE, ZeroLatencyAgent  # noqa: E402
from engine.agents.base import EpisodeContext  # noqa: E402
from engine.client import RolloutClient  # noqa: E402
from engine.domain import (  # noqa: E402
    SamplingParams,
    StoppingCriteria,
    Task,
)
from engine.events import RolloutRequested  # noqa: E402
from engine.ops.embedded import start_redis_server  # noqa: E402
from engine.ops.processes import Processes  # noqa: E402
from engine.sample import Sample  # noqa: E402
from workers.cli import ROLLOUT  # noqa: E402

CONFIG = ROOT / "bench" / "rollout_evaluators.py"
PER_PROMPT = 8
TIMINGS = {"heartbeat_ms": 2000, "claim_idle_ms": 30000, "block_ms": 1000}
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def scheduler_available() -> bool:
    try:
        import workers.scheduler  # noqa: F401
    except ImportError:
        return False
    return True


class EngineArm:
    def __init__(
        self,
        args: argparse.Namespace,
        tmp: Path,
        *,
        env: dict[str, str] | None = None,
        timings: dict[str, int] | None = None,
    ) -> None:
        self.args = args
        self.tmp = tmp
        self.iter_load = True  # also time client.iter_load after client.load
        self.redis = start_redis_server()
        # The URL holds the admin password: the launcher hands it over in the environment.
        self.procs = Processes(tmp, rollout=ROLLOUT, env={"PYTHONPATH": str(ROOT), **(env or {})},
                               settings={"redis_url": self.redis.url,
                                         **(TIMINGS if timings is None else timings)},
                               grace_s=30)
        self.real_scheduler = scheduler_available() and not args.play_scheduler
        self.client: RolloutClient | None = None
        self.seq = 0
        self.breakdown: dict[str, float] = {}

    def spawn(self, name: str, command: str, *extra: str) -> None:
        """``rollout <command>``, under cProfile (``--profile DIR``) when asked."""
        prof = getattr(self.args, "profile", None)
        wrap = ["-m", "cProfile", "-o", str(Path(prof) / f"{name}.prof")] if prof else []
        self.procs.start(name, command, *extra, python=wrap)

    def start(self) -> None:
        n_prompts = self.args.samples // PER_PROMPT
        data = self.tmp / "prompts.jsonl"
        rows = (f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(n_prompts))
        data.write_text("".join(rows))
        (self.tmp / "rollout.yaml").write_text(
            "rollout:\n  datasets:\n"
            f"    bench: {{path: {data}, task_type: fast, n_samples_per_prompt: {PER_PROMPT}}}\n"
        )
        layout = '{"node-a": {"gpus": [0, 1, 2, 3], "cpu": 100000, "memory_gb": 100000}}'
        if self.real_scheduler:
            self.spawn(
                "scheduler", "scheduler",
                "--rollout-config", str(self.tmp / "rollout.yaml"),
                "--evaluator-config", str(CONFIG), "--cluster-layout", layout,
                "--scheduler-id", "bench", "--log-level", "WARNING",
            )
        for w in range(self.args.workers):
            self.spawn(
                f"worker{w}", "worker", "--evaluator-config", str(CONFIG),
                "--worker-id", f"w{w}", "--sandbox", "none", "--quiet",
                "--max-batches", str(self.args.max_batches), "--log-level", "WARNING",
            )
        self.spawn("finalizer", "finalizer", "--worker-id", "fin", "--log-level", "WARNING")

    def cpu_by_process(self) -> dict[str, float]:
        return {name: cpu_seconds(self.procs[name].pid) for name in self.procs}

    def engine_cpu(self) -> float:
        return sum(self.cpu_by_process().values())

    def redis_cpu(self) -> float:
        proc = self.redis._proc
        return cpu_seconds(proc.pid) if proc is not None else 0.0

    async def rollout(self, n_samples: int, *, overlap: bool = False) -> dict[str, float]:
        """One rollout of ``n_samples``: request -> ready (``wall_s``, and the engine's CPU
        over it), then ``load`` (``load_s``). ``overlap``: ``client.wait_load`` instead, which
        folds the stream while it is written: ``wall_s`` is request -> samples loaded and
        ``load_s`` is 0."""
        if self.client is None:
            self.client = RolloutClient.connect(self.redis.url, block_ms=1000)
        client = self.client
        self.seq += 1
        by0 = self.cpu_by_process()
        cpu0, redis0, play_cpu = sum(by0.values()), self.redis_cpu(), 0.0
        t0 = time.perf_counter()
        rid = await client.request(
            iteration=self.seq, n_prompts=n_samples // PER_PROMPT,
            n_samples_per_prompt=PER_PROMPT, seed=self.seq, rollout_id=f"bench-{self.seq}",
        )
        if not self.real_scheduler:
            play_cpu = await self._play(rid)
        if overlap:
            ready, samples = await client.wait_load(rid, timeout=600)
        else:
            ready = await client.wait_ready(rid, timeout=600)
        wall = time.perf_counter() - t0
        by1 = self.cpu_by_process()
        cpu = sum(by1.values()) - cpu0 + play_cpu
        self.breakdown = {
            k: round(1000 * (by1[k] - by0[k]) / n_samples, 4) for k in by1
        }
        redis_cpu = self.redis_cpu() - redis0
        t1 = time.perf_counter()
        if not overlap:
            samples = await client.load(rid)
        load_s = time.perf_counter() - t1
        if ready.n_completed != n_samples or len(samples) != n_samples:
            raise RuntimeError(f"rollout {rid}: {ready.n_completed} of {n_samples} completed")
        del samples
        iter_load_s = 0.0
        if self.iter_load:
            t2, n_iter = time.perf_counter(), 0
            async for chunk in client.iter_load(rid, 4096):
                n_iter += len(chunk)
            iter_load_s = time.perf_counter() - t2
            if n_iter != n_samples:
                raise RuntimeError(f"rollout {rid}: iter_load gave {n_iter} of {n_samples}")
        return {
            "iter_load_s": iter_load_s,
            "samples_per_s": n_samples / wall,
            "engine_cpu_ms_per_sample": 1000 * cpu / n_samples,
            "redis_cpu_ms_per_sample": 1000 * redis_cpu / n_samples,
            "wall_s": wall,
            "load_s": load_s,
        }

    async def _play(self, rid: str) -> float:
        from tests.actors.play import play_scheduler

        assert self.client is not None
        log = self.client.log
        entries = await log.read_all(log.names.control)
        request = next(
            e.event for e in entries
            if isinstance(e.event, RolloutRequested) and e.event.rollout_id == rid
        )
        t0 = time.process_time()
        await play_scheduler(log, request, evaluator_id="fast", batch_size=BATCH_SIZE)
        return time.process_time() - t0

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
        self.procs.stop()
        self.redis.stop()


async def episode_sample(agent: ZeroLatencyAgent, task: Task) -> Sample:
    """One sample the way a worker of the seeds runs it: init -> run -> eval -> cleanup, then
    a ``Sample`` of the task (the in-process baseline's and the Ray / rq arms' episode)."""
    ctx = EpisodeContext(
        rollout_id=task.rollout_id, sample_id=task.sample_id, attempt=1,
        stopping=_STOPPING, sampling_params=_SAMPLING, tmp_dir=Path(tempfile.gettempdir()),
    )
    episode = agent.episode(task)
    try:
        await episode.init(ctx)
        result = await episode.run(ctx)
        reward = await episode.eval(ctx, result)
    finally:
        await episode.cleanup(ctx)
    return Sample.from_agent_result(task, result, reward)


_STOPPING, _SAMPLING = StoppingCriteria(), SamplingParams()


async def inprocess(n_samples: int) -> float:
    """Samples/s of the seeds' architecture: one asyncio loop, no events."""
    agent = ZeroLatencyAgent()
    tasks = [
        Task(sample_id=f"t{i}", rollout_id="inproc", index=i, group_index=i // PER_PROMPT,
             prompt=f"q{i // PER_PROMPT}", label=str(i), dataset_name="bench", task_type="fast",
             source_line=1)
        for i in range(n_samples)
    ]
    async def one(task: Task, sem: asyncio.Semaphore) -> Sample:
        async with sem:
            return await episode_sample(agent, task)

    t0 = time.perf_counter()
    sems = [asyncio.Semaphore(BATCH_SIZE) for _ in range(0, n_samples, BATCH_SIZE)]
    samples = await asyncio.gather(*(one(t, sems[t.index // BATCH_SIZE]) for t in tasks))
    elapsed = time.perf_counter() - t0
    assert len(samples) == n_samples
    return n_samples / elapsed


def rss_mb(pid: int) -> float:
    """Peak resident memory of a process (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def scaling(args: argparse.Namespace) -> dict[str, Any]:
    """One rollout per size, on one engine: per-sample cost by process, and of loading."""
    sizes = [int(x) for x in args.scaling.split(",")]
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp_name:
        arm = EngineArm(args, Path(tmp_name))
        arm.start()
        try:
            await arm.rollout(PER_PROMPT * 64)  # warm-up
            for n in sizes:
                r = await arm.rollout(n)
                row = {
                    "samples_per_s": round(r["samples_per_s"], 1),
                    "engine_cpu_ms_per_sample": round(r["engine_cpu_ms_per_sample"], 4),
                    "by_process_ms_per_sample": arm.breakdown,
                    "load_ms_per_sample": round(1000 * r["load_s"] / n, 4),
                    "iter_load_ms_per_sample": round(1000 * r["iter_load_s"] / n, 4),
                    "finalizer_peak_rss_mb": round(rss_mb(arm.procs["finalizer"].pid), 1),
                }
                out[str(n)] = row
                print(f"{n} samples: {json.dumps(row)}", flush=True)
        finally:
            await arm.close()
    return {"scaling": out, "workers": args.workers, "batch_size": BATCH_SIZE}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    if args.scaling:
        return await scaling(args)
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp_name:
        arm = EngineArm(args, Path(tmp_name))
        arm.start()
        try:
            await arm.rollout(max(PER_PROMPT * 64, args.samples // 10))  # warm-up
            engine_rounds, inproc_rounds = [], []
            for r in range(args.rounds):
                engine_rounds.append(await arm.rollout(args.samples))
                inproc_rounds.append(await inprocess(args.samples))
                e = engine_rounds[-1]
                print(
                    f"round {r + 1}: engine {e['samples_per_s']:,.0f} samples/s "
                    f"({e['engine_cpu_ms_per_sample']:.3f} ms engine CPU, "
                    f"{e['redis_cpu_ms_per_sample']:.3f} ms redis CPU per sample); "
                    f"in-process {inproc_rounds[-1]:,.0f} samples/s",
                    flush=True,
                )
                print(f"  engine CPU ms/sample by process: {arm.breakdown}", flush=True)
        finally:
            await arm.close()
    med = {k: statistics.median(r[k] for r in engine_rounds) for k in engine_rounds[0]}
    inproc = statistics.median(inproc_rounds)
    return {
        "samples": args.samples,
        "rounds": args.rounds,
        "workers": args.workers,
        "scheduler": "workers.scheduler" if arm.real_scheduler else "play_scheduler (in-process)",
        "batch_size": BATCH_SIZE,
        "samples_per_s": round(med["samples_per_s"], 1),
        "engine_cpu_ms_per_sample": round(med["engine_cpu_ms_per_sample"], 4),
        "redis_cpu_ms_per_sample": round(med["redis_cpu_ms_per_sample"], 4),
        "load_s": round(med["load_s"], 3),
        "iter_load_s": round(med["iter_load_s"], 3),
        "inprocess_samples_per_s": round(inproc, 1),
        "vs_inprocess_ratio": round(med["samples_per_s"] / inproc, 4),
        "target_samples_per_s": 2000,
        "target_engine_cpu_ms_per_sample": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=8)
    parser.add_argument("--play-scheduler", action="store_true",
                        help="use the tests' scheduler player even if workers.scheduler exists")
    parser.add_argument("--scaling", metavar="N,N,...",
                        help="instead of rounds: one rollout of each size, per-sample costs")
    parser.add_argument("--profile", metavar="DIR",
                        help="run the engine's processes under cProfile, one DIR/<name>.prof each")
    args = parser.parse_args()
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    if args.samples % PER_PROMPT:
        parser.error(f"--samples must be a multiple of {PER_PROMPT}")
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


# Harness pieces other benches share (bench/peers.py): /proc reads that tolerate a process
# that is gone (a killed worker, a short-lived child).


def proc_stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from field 3 on (after the command name), or None when the
    process is gone: index 1 is the parent pid, 11-14 utime, stime, cutime, cstime."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def cpu_with_children(pid: int) -> float:
    """User + system CPU of a process and of the children it has reaped (0 when gone)."""
    f = proc_stat(pid)
    if f is None:
        return 0.0
    return sum(int(x) for x in f[11:15]) / _TICK


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            f = proc_stat(int(name))
            if f is not None:
                parents[int(name)] = int(f[1])
    out: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier and p not in out}
        out |= frontier
    return out


def cpu_of(pids: Iterable[int]) -> float:
    """User + system CPU of ``pids`` together; a process that is gone counts 0."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


if __name__ == "__main__":
    main()
