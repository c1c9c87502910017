"""The trainer's side of a finished rollout: ``client.load`` and ``client.iter_load``.

Runs one rollout of ``--samples`` samples through ``bench/rollout.py``'s engine arm (the
zero-latency agent), then, ``--rounds`` times, loads it with ``load`` and with
``iter_load(rid, --chunk)`` and reports per call the wall time and the trainer's CPU
(``time.process_time``), medians over the rounds; then once more each under ``tracemalloc``
for its peak traced memory (``iter_load`` with chunks of ``--memory-chunk``). The last line
printed is one JSON object.

    python bench/load.py [--samples 20000] [--rounds 5] [--chunk 4096] [--memory-chunk 1000]

The engine code measured is the one on ``sys.path`` first: run it with ``PYTHONPATH`` set
to a checkout to measure that checkout (A/B: the same file, two checkouts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: a checkout given there is measured

from bench.rollout import PER_PROMPT, EngineArm  # noqa: E402


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        arm = EngineArm(args, Path(tmp))
        arm.iter_load = False
        arm.start()
        try:
            await arm.rollout(args.samples)
            client = arm.client
            assert client is not None
            rid = f"bench-{arm.seq}"
            rows: dict[str, list[float]] = {
                "load_s": [], "load_cpu_s": [], "iter_load_s": [], "iter_load_cpu_s": []
            }
            for _ in range(args.rounds):
                t, c = time.perf_counter(), time.process_time()
                samples = await client.load(rid)
                rows["load_s"].append(time.perf_counter() - t)
                rows["load_cpu_s"].append(time.process_time() - c)
                if len(samples) != args.samples:
                    raise RuntimeError(f"load gave {len(samples)} of {args.samples}")
                del samples
                t, c, n = time.perf_counter(), time.process_time(), 0
                async for chunk in client.iter_load(rid, args.chunk):
                    n += len(chunk)
                rows["iter_load_s"].append(time.perf_counter() - t)
                rows["iter_load_cpu_s"].append(time.process_time() - c)
                if n != args.samples:
                    raise RuntimeError(f"iter_load gave {n} of {args.samples}")
            tracemalloc.start()
            samples = await client.load(rid)
            _, load_peak = tracemalloc.get_traced_memory()
            del samples
            tracemalloc.reset_peak()
            base, _ = tracemalloc.get_traced_memory()
            async for chunk in client.iter_load(rid, args.memory_chunk):
                del chunk
            _, iter_peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        finally:
            await arm.close()
    out: dict[str, Any] = {"samples": args.samples, "rounds": args.rounds, "chunk": args.chunk}
    for name, values in rows.items():
        out[name] = round(statistics.median(values), 3)
    out["load_cpu_ms_per_sample"] = round(1000 * out["load_cpu_s"] / args.samples, 4)
    out["iter_load_cpu_ms_per_sample"] = round(1000 * out["iter_load_cpu_s"] / args.samples, 4)
    out["load_peak_mb"] = round(load_peak / 1e6, 1)
    out[f"iter_load_{args.memory_chunk}_peak_mb"] = round((iter_peak - base) / 1e6, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--memory-chunk", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=8)
    parser.add_argument("--play-scheduler", action="store_true")
    args = parser.parse_args()
    args.profile = None
    if args.samples % PER_PROMPT:
        parser.error(f"--samples must be a multiple of {PER_PROMPT}")
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
