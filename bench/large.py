"""One large rollout through the full engine: per-sample cost by phase, memory by process.

The engine of ``bench/rollout.py`` (a real redis-server, the scheduler, two evaluator workers
and a finalizer, each its own process; the zero-latency agent) runs one rollout of
``--samples`` samples (default 1,000,000), and the trainer (this process) then reads it back
with ``client.iter_load`` in chunks. Before it, the same at ``--baseline`` samples (default
100,000), each size on a fresh engine (so a process's peak RSS is that rollout's).

Phases, bounded by the rollout stream's own entry ids (Redis stamps them with its clock, in
ms; the stream is paged through once after the rollout to find them):

* ``plan``: the request -> ``RolloutPlanned`` (the scheduler writes every task);
* ``run``: ``RolloutPlanned`` -> the last terminal sample event (admission, the workers'
  episodes, their events);
* ``finalize``: the last terminal -> ``RolloutReady`` on the rollout stream;
* ``load``: ``iter_load`` in this process, until its last chunk.

Per phase: wall microseconds per sample and, per process, CPU microseconds per sample (user +
system from ``/proc/<pid>/stat``, sampled every ``--tick`` seconds and interpolated at the
phase bounds; ``load`` counts this process and redis-server; the engine's processes are
stopped before it, so their memory does not add to the trainer's). Per process: peak RSS
(``VmHWM``), and its growth per sample over its RSS right before the request (what the
rollout holds, without the imports); Redis ``used_memory`` after the rollout (and its growth
per sample). For ``load``, this process's sampled RSS growth while it loads. The last line
printed is one JSON object with ``per_sample_cost_ratio_1m_vs_100k`` (engine CPU per sample
of the large rollout over the baseline's; flat is ~1.0) and the finalizer's peak RSS per
sample.

    python bench/large.py                      # 100k, then 1M (minutes; ~GBs of memory)
    python bench/large.py --samples 200000 --baseline 20000
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from bench.rollout import PER_PROMPT, EngineArm, cpu_seconds  # noqa: E402
from engine.client import RolloutClient  # noqa: E402

TERMINALS = (b"SampleCompleted", b"SampleAborted")


def status_kb(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` figure in kB (``VmHWM``: peak RSS, ``VmRSS``: now)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


@dataclass
class Sampler:
    """CPU seconds of each process, every ``tick`` seconds, with the wall time."""

    pids: dict[str, int]
    tick: float
    times: list[float] = field(default_factory=list)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    rss_kb: dict[str, list[int]] = field(default_factory=dict)

    def sample(self) -> None:
        self.times.append(time.time())
        for name, pid in self.pids.items():
            cpu, rss = self.cpu.setdefault(name, []), self.rss_kb.setdefault(name, [])
            try:
                value = time.process_time() if pid == os.getpid() else cpu_seconds(pid)
                kb = status_kb(pid, "VmRSS")
            except (FileNotFoundError, ProcessLookupError):  # stopped before the load
                value, kb = (cpu[-1] if cpu else 0.0), 0
            cpu.append(value)
            rss.append(kb)

    def peak_rss_kb(self, name: str, a: float, b: float) -> int:
        """The largest sampled RSS of ``name`` between wall times ``a`` and ``b``."""
        i, j = bisect.bisect_left(self.times, a), bisect.bisect_right(self.times, b)
        return max(self.rss_kb[name][i:j] or [0])

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.tick)
            except TimeoutError:
                pass
        self.sample()

    def at(self, name: str, t: float) -> float:
        """CPU seconds of ``name`` at wall time ``t`` (linear between samples)."""
        ts, vs = self.times, self.cpu[name]
        i = bisect.bisect_left(ts, t)
        if i <= 0:
            return vs[0]
        if i >= len(ts):
            return vs[-1]
        t0, t1 = ts[i - 1], ts[i]
        w = (t - t0) / (t1 - t0) if t1 > t0 else 1.0
        return vs[i - 1] + w * (vs[i] - vs[i - 1])


async def phase_bounds(url: str, stream: str) -> dict[str, float]:
    """Wall times (s) of the request, ``RolloutPlanned``, the last terminal and the
    ``RolloutReady`` on the rollout stream, from its entry ids (paged, type by bytes)."""
    r = aioredis.from_url(url)
    out: dict[str, float] = {}
    start = "-"
    last_terminal = None
    try:
        while True:
            rows = await r.xrange(stream, min=start, max="+", count=5000)
            if not rows:
                break
            for raw_id, fields in rows:
                ms = int(raw_id.split(b"-")[0]) / 1000
                body = next(iter(fields.values()))
                if "request" not in out:
                    out["request"] = ms
                head = body[:120]
                if b"RolloutPlanned" in head and "planned" not in out:
                    out["planned"] = ms
                elif b"RolloutReady" in head and "ready" not in out:
                    out["ready"] = ms
                elif any(t in head for t in TERMINALS) and "ready" not in out:
                    last_terminal = ms
            start = "(" + rows[-1][0].decode()
    finally:
        await r.aclose()
    if last_terminal is not None:
        out["last_terminal"] = last_terminal
    return out


async def redis_used_memory(url: str) -> int:
    r = aioredis.from_url(url)
    try:
        info = await r.info("memory")
    finally:
        await r.aclose()
    return int(info["used_memory"])


def _args(ns: argparse.Namespace) -> argparse.Namespace:
    """What ``bench.rollout.EngineArm`` reads of its arguments."""
    return argparse.Namespace(
        samples=ns.size, workers=ns.workers, max_batches=ns.max_batches,
        play_scheduler=False, profile=None,
    )


async def one_size(args: argparse.Namespace, n: int, load: bool) -> dict[str, Any]:
    """A fresh engine, a warm-up, then one rollout of ``n`` samples and its load."""
    ns = argparse.Namespace(**vars(args), size=n)
    with tempfile.TemporaryDirectory(prefix="bench-large-") as tmp_name:
        arm = EngineArm(_args(ns), Path(tmp_name))
        arm.iter_load = False
        arm.start()
        try:
            return await _measure(arm, n, load, args)
        finally:
            await arm.close()


async def _measure(
    arm: EngineArm, n: int, load: bool, args: argparse.Namespace
) -> dict[str, Any]:
    client = RolloutClient.connect(arm.redis.url, block_ms=1000)
    arm.client = client
    # warm-up: every process imported and its consumer groups made
    warm = await client.request(iteration=0, n_prompts=64, n_samples_per_prompt=PER_PROMPT,
                                seed=0, rollout_id="warm")
    await client.wait_ready(warm, timeout=600)
    assert arm.redis._proc is not None
    pids = {name: arm.procs[name].pid for name in arm.procs}
    pids["redis"] = arm.redis._proc.pid
    pids["trainer"] = os.getpid()
    sampler = Sampler(pids, args.tick)
    stop = asyncio.Event()
    watcher = asyncio.create_task(sampler.run(stop))
    memory0 = await redis_used_memory(arm.redis.url)
    before = {name: status_kb(pid, "VmRSS") for name, pid in pids.items()}
    t_request = time.time()
    rid = await client.request(iteration=1, n_prompts=n // PER_PROMPT,
                               n_samples_per_prompt=PER_PROMPT, seed=1, rollout_id="large")
    ready = await client.wait_ready(rid, timeout=args.timeout)
    t_ready_seen = time.time()
    if ready.n_completed != n:
        raise RuntimeError(f"rollout {rid}: {ready.n_completed} of {n} completed")
    memory1 = await redis_used_memory(arm.redis.url)
    peak = {name: status_kb(pid, "VmHWM") for name, pid in pids.items() if name != "trainer"}
    # The engine's own processes are done: stop them before the load, so their memory
    # does not add to the trainer's (a 1M-sample load needs several GB).
    arm.procs.stop()
    t_load0 = t_load1 = time.time()
    n_loaded = 0
    if load:
        async for chunk in client.iter_load(rid, args.chunk):
            n_loaded += len(chunk)
        t_load1 = time.time()
        if n_loaded != n:
            raise RuntimeError(f"rollout {rid}: iter_load gave {n_loaded} of {n}")
    stop.set()
    await watcher
    bounds = await phase_bounds(arm.redis.url, client.log.names.rollout(rid))
    await client.aclose()
    arm.client = None
    edges = {
        "plan": (t_request, bounds["planned"]),
        "run": (bounds["planned"], bounds["last_terminal"]),
        "finalize": (bounds["last_terminal"], bounds["ready"]),
    }
    if load:
        edges["load"] = (t_load0, t_load1)
    phases: dict[str, Any] = {}
    engine = [name for name in pids if name not in ("redis", "trainer")]
    for phase, (a, b) in edges.items():
        names = ["trainer", "redis"] if phase == "load" else [*engine, "redis"]
        cpu = {name: 1e6 * (sampler.at(name, b) - sampler.at(name, a)) / n for name in names}
        phases[phase] = {
            "wall_us_per_sample": round(1e6 * (b - a) / n, 2),
            "cpu_us_per_sample": {k: round(v, 2) for k, v in cpu.items()},
        }
    total_cpu = {
        name: 1e6 * (sampler.at(name, bounds["ready"]) - sampler.at(name, t_request)) / n
        for name in engine
    }
    return {
        "samples": n,
        "samples_per_s": round(n / (bounds["ready"] - t_request), 1),
        "wall_s": round(t_ready_seen - t_request, 2),
        "load_s": round(t_load1 - t_load0, 2) if load else None,
        "phases": phases,
        "engine_cpu_us_per_sample": round(sum(total_cpu.values()), 2),
        "engine_cpu_us_per_sample_by_process": {k: round(v, 1) for k, v in total_cpu.items()},
        "peak_rss_mb": {k: round(v / 1024, 1) for k, v in peak.items()},
        "rss_before_mb": {k: round(v / 1024, 1) for k, v in before.items()},
        "peak_rss_growth_bytes_per_sample": {
            k: round(1024 * (v - before[k]) / n, 1) for k, v in peak.items()
        },
        "load_rss_growth_bytes_per_sample": (
            round(1024 * (sampler.peak_rss_kb("trainer", t_load0, t_load1) - before["trainer"])
                  / n, 1) if load else None
        ),
        "redis_used_memory_mb": round(memory1 / 2**20, 1),
        "redis_bytes_per_sample": round((memory1 - memory0) / n, 1),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [args.baseline, args.samples] if args.baseline else [args.samples]
    rows: dict[str, Any] = {}
    for n in sizes:
        load = not args.no_load and (args.load_max is None or n <= args.load_max)
        row = await one_size(args, n, load)
        rows[str(n)] = row
        print(f"{n} samples: {json.dumps(row)}", flush=True)
    big, base = rows[str(args.samples)], rows.get(str(args.baseline))
    out: dict[str, Any] = {"sizes": rows, "workers": args.workers}
    if base is not None:
        phase_ratio = {
            phase: _ratio(
                sum(big["phases"][phase]["cpu_us_per_sample"].values()),
                sum(base["phases"][phase]["cpu_us_per_sample"].values()),
            )
            for phase in big["phases"] if phase in base["phases"]
        }
        out["per_phase_cpu_ratio"] = phase_ratio
        out["per_sample_cost_ratio_1m_vs_100k"] = _ratio(
            big["engine_cpu_us_per_sample"], base["engine_cpu_us_per_sample"]
        )
        out["finalizer_rss_growth_per_sample_ratio"] = _ratio(
            big["peak_rss_growth_bytes_per_sample"]["finalizer"],
            base["peak_rss_growth_bytes_per_sample"]["finalizer"],
        )
    out["samples"] = args.samples
    out["baseline"] = args.baseline
    out["finalizer_peak_rss_mb"] = big["peak_rss_mb"]["finalizer"]
    out["peak_rss_growth_bytes_per_sample"] = big["peak_rss_growth_bytes_per_sample"]
    out["redis_bytes_per_sample"] = big["redis_bytes_per_sample"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--baseline", type=int, default=100_000,
                        help="the smaller rollout compared with (0: none)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=4096, help="iter_load chunk size")
    parser.add_argument("--tick", type=float, default=0.25, help="CPU sampling period (s)")
    parser.add_argument("--timeout", type=float, default=7200.0, help="wait_ready limit (s)")
    parser.add_argument("--no-load", action="store_true", help="skip the load phase")
    parser.add_argument("--load-max", type=int, default=None,
                        help="load only rollouts of at most this many samples")
    args = parser.parse_args()
    for n in (args.samples, args.baseline):
        if n % PER_PROMPT:
            parser.error(f"sizes must be multiples of {PER_PROMPT}, got {n}")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
