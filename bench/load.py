"""The trainer's side of a finished rollout: ``client.load`` and ``client.iter_load``.

Runs one rollout of ``--samples`` samples through ``bench/rollout.py``'s engine arm (the
zero-latency agent), then, ``--rounds`` times, loads it with ``load`` and with
``iter_load(rid, --chunk)`` and reports per call the wall time and the trainer's CPU
(``time.process_time``), medians over the rounds; then once more each under ``tracemalloc``
for its peak traced memory (``iter_load`` with chunks of ``--memory-chunk``). The last line
printed is one JSON object.

    python bench/load.py [--samples 20000] [--rounds 5] [--chunk 4096] [--memory-chunk 1000]
    python bench/load.py --sizes 10000,100000   # per-sample cost by size, in memory

``--sizes``: no engine and no Redis; for each size a synthetic grpo stream (16-token
samples: request, tasks, a start and a completion per sample, ready) is encoded, then
folded and built as ``load`` does (``StreamLoad(keep=True)`` + ``trainer_samples``) and
folded as ``iter_load``'s first pass does (``StreamLoad(keep=False)``: the records only),
the collector paused as in the client: microseconds of CPU per sample, and the records'
traced bytes per sample.

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


def sizes(spec: str) -> dict[str, Any]:
    import gc

    from engine.events import (
        RolloutReady,
        RolloutRequested,
        SampleCompleted,
        SampleStarted,
        TaskFetched,
    )
    from engine.events.codec import encode
    from engine.projections.samples import trainer_samples
    from engine.runtime.readback import StreamLoad

    out: dict[str, Any] = {}
    for n in (int(x) for x in spec.split(",")):
        ids = [f"s-{i}" for i in range(n)]
        events: list[Any] = [RolloutRequested(rollout_id="r", n_prompts=max(1, n // 8))]
        events += [
            TaskFetched(rollout_id="r", sample_id=sid, index=i, group_index=i // 8,
                        prompt=f"q{i // 8}", dataset="d", task_type="t")
            for i, sid in enumerate(ids)
        ]
        for sid in ids:
            events.append(SampleStarted(rollout_id="r", sample_id=sid))
            events.append(SampleCompleted(
                rollout_id="r", sample_id=sid, prompt_ids=[1] * 8, response_ids=[2] * 16,
                logprobs=[-0.5] * 16, loss_mask=[1] * 16, reward=1.0,
            ))
        events.append(RolloutReady(rollout_id="r", sample_ids=ids))
        rows = [(f"{i + 1}-0", encode(e)) for i, e in enumerate(events)]
        del events
        gc.collect()
        gc.disable()
        try:
            t = time.process_time()
            load = StreamLoad("r", keep=True)
            load.feed(rows)
            samples = trainer_samples(load.rollout())
            load_s = time.process_time() - t
            del samples, load
            t = time.process_time()
            index = StreamLoad("r", keep=False)
            index.feed(rows)
            index_s = time.process_time() - t
            del index
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            index = StreamLoad("r", keep=False)
            index.feed(rows)
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
        finally:
            gc.enable()
        row = {
            "load_us_per_sample": round(1e6 * load_s / n, 1),
            "index_us_per_sample": round(1e6 * index_s / n, 1),
            "index_bytes_per_sample": round(held / n, 1),
        }
        out[str(n)] = row
        print(f"{n} samples: {json.dumps(row)}", flush=True)
    return {"sizes": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--memory-chunk", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=8)
    parser.add_argument("--play-scheduler", action="store_true")
    parser.add_argument("--sizes", metavar="N,N,...",
                        help="instead: per-sample cost of folding and building, in memory")
    args = parser.parse_args()
    if args.sizes:
        print(json.dumps(sizes(args.sizes)))
        return
    args.profile = None
    if args.samples % PER_PROMPT:
        parser.error(f"--samples must be a multiple of {PER_PROMPT}")
    print(json.dumps(asyncio.run(measure(args))))


if __name__ == "__main__":
    main()
