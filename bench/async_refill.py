"""Async refill vs the synchronous loop, with real weight syncs between iterations.

The engine: a real redis-server, a tinylm server (``--weight-version 0``), one scheduler,
``--workers`` evaluator workers running the multi-turn agent of
``bench/async_refill_evaluators.py``, a finalizer and a weight syncer, each its own process.
The trainer (this process) runs ``--iterations`` iterations of the loop of
``engine.client.RefillLoop``: wait for rollout N, "train" on it, write new weights (the tiny
model's weights moved by seeded noise, saved as a Hugging Face folder) and publish them. The
training step is simulated: it sleeps ``--train-s`` seconds, by default the generation time of
one rollout (the median of three warm-up rollouts), so the two take about as long.

- sync arm (``ahead=0``): request N, wait, train, publish -- generation and training alternate;
- async arm (``ahead=1``): N+1 is requested before the trainer gets N, so it generates while
  the trainer trains on N; each publication lands at the next turn boundary of N+1's
  trajectories (the workers' gate).

``async_vs_sync_ratio`` is async iterations/s over sync iterations/s (the ideal, with training
as long as generation, is 2). ``stale_tokens_loaded`` counts sampled tokens the trainer loaded
whose weight version was more than ``--max-staleness`` versions behind the trainer's version
at load time (the versions it had published); ``unknown_version_tokens`` counts sampled tokens
without a version. The last line printed is one JSON object.

    python bench/async_refill.py [--iterations 8] [--prompts 8] [--rounds 3]

``--rounds`` runs the pair of arms that many times, alternating, and reports the median
ratio (the machine's load moves the figures a lot between runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.client import Iteration, RefillLoop, RolloutClient  # noqa: E402
from engine.ops.embedded import start_redis_server  # noqa: E402
from engine.ops.processes import Processes  # noqa: E402
from engine.ops.tinylm import init_model  # noqa: E402
from workers.cli import ROLLOUT  # noqa: E402

CONFIG = ROOT / "bench" / "async_refill_evaluators.py"
TIMINGS = {"heartbeat_ms": 1000, "claim_idle_ms": 20000, "block_ms": 200}


def write_weights(src: Path, dst: Path, seed: int, scale: float = 0.02) -> Path:
    """A trainer step's output: ``src``'s weights moved by seeded noise, saved to ``dst``."""
    import torch
    from safetensors.torch import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    moved = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    save_file(moved, str(dst / "model.safetensors"))
    return dst


class Engine:
    def __init__(self, tmp: Path, workers: int) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        init_model(self.model, seed=0, train_steps=0)
        self.redis = start_redis_server()
        # The URL holds the admin password: the launcher hands it over in the environment.
        self.procs = Processes(tmp, rollout=ROLLOUT, env={"PYTHONPATH": str(ROOT)}, settings={
            "redis_url": self.redis.url, **TIMINGS, "log_level": "WARNING"})
        url = self.procs.serve_tinylm("tinylm", self.model, "--weight-version", "0").url
        data = tmp / "prompts.jsonl"
        data.write_text("".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(4096)))
        (tmp / "rollout.yaml").write_text(
            f"rollout:\n  datasets:\n    bench: {{path: {data}, task_type: turns}}\n"
        )
        self.procs.start("scheduler", "scheduler", "--rollout-config", str(tmp / "rollout.yaml"),
                         "--evaluator-config", str(CONFIG), "--scheduler-id", "bench")
        for w in range(workers):
            self.procs.start(f"worker{w}", "worker", "--evaluator-config", str(CONFIG),
                             "--worker-id", f"w{w}", "--sandbox", "none", "--quiet",
                             "--sglang-url", url)
        self.procs.start("finalizer", "finalizer", "--worker-id", "fin")
        self.procs.start("sync", "sync", "--worker-id", "sync", "--sglang-url", url)

    def check(self) -> None:
        self.procs.check_alive()

    def close(self) -> None:
        self.procs.stop()
        self.redis.stop()


def stale_tokens(it: Iteration, trainer_version: int, bound: int) -> tuple[int, int, int]:
    """(sampled tokens, tokens older than ``bound`` versions behind, tokens of no version)."""
    total = stale = unknown = 0
    for sample in it.samples:
        if sample.token_versions is None:
            continue
        mask = sample.loss_mask.tolist()
        versions = sample.token_versions.tolist()
        for m, v in zip(mask, versions, strict=True):
            if not m:
                continue
            total += 1
            if v < 0:
                unknown += 1
            elif v < trainer_version - bound:
                stale += 1
    return total, stale, unknown


async def arm(
    client: RolloutClient, engine: Engine, *, ahead: int, iterations: int, train_s: float,
    version: int, start_iteration: int, args: argparse.Namespace,
) -> dict[str, Any]:
    loop = RefillLoop(
        client, ahead=ahead, version=version, start_iteration=start_iteration, timeout=600,
        n_prompts=args.prompts, n_samples_per_prompt=args.samples_per_prompt,
    )
    totals = {"tokens": 0, "stale": 0, "unknown": 0}
    spread: dict[str, int] = {}
    waited = trained = 0.0
    waits: list[float] = []
    t0 = time.perf_counter()
    mark = t0
    async for it in loop.iterations(iterations):
        waited += time.perf_counter() - mark
        waits.append(round(time.perf_counter() - mark, 3))
        engine.check()
        total, stale, unknown = stale_tokens(it, loop.version, args.max_staleness)
        totals["tokens"] += total
        totals["stale"] += stale
        totals["unknown"] += unknown
        for v, n in it.ready.version_tokens.items():
            spread[v] = spread.get(v, 0) + n
        t_train = time.perf_counter()
        await asyncio.sleep(train_s)  # the simulated trainer step
        new = loop.version + 1
        weights = write_weights(engine.model, engine.tmp / "weights" / f"v{new}", seed=new)
        await loop.publish(new, str(weights))
        mark = time.perf_counter()
        trained += mark - t_train
    await client.wait_version_active(loop.version, timeout=120)
    wall = time.perf_counter() - t0
    return {
        "iterations_per_s": iterations / wall,
        "wall_s": round(wall, 3),
        "waiting_s": round(waited, 3),  # the trainer waiting for rollouts (requests included)
        "training_s": round(trained, 3),  # train step + weights written + publish
        "waits_s": waits,
        "sampled_tokens": totals["tokens"],
        "stale_tokens_loaded": totals["stale"],
        "unknown_version_tokens": totals["unknown"],
        "version_tokens": spread,
        "final_version": loop.version,
        "next_iteration": loop._next,
    }


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    engine = Engine(tmp, args.workers)
    try:
        client = RolloutClient.connect(engine.redis.url, block_ms=200)
        try:
            # Warm-up: the processes start; then the generation time of one rollout, the
            # median of three (the trainer step is as long unless --train-s says otherwise).
            t0 = time.perf_counter()
            rid = await client.request(iteration=0, n_prompts=args.prompts,
                                       n_samples_per_prompt=args.samples_per_prompt)
            await client.wait_ready(rid, timeout=600)
            first_s = time.perf_counter() - t0
            timings = []
            for _ in range(3):
                t1 = time.perf_counter()
                rid = await client.request(iteration=0, n_prompts=args.prompts,
                                           n_samples_per_prompt=args.samples_per_prompt)
                await client.wait_ready(rid, timeout=600)
                timings.append(time.perf_counter() - t1)
            generation_s = statistics.median(timings)
            train_s = args.train_s if args.train_s is not None else generation_s
            rounds: list[dict[str, Any]] = []
            version, iteration = 0, 1
            for _ in range(args.rounds):  # the arms alternate, versions go on increasing
                pair: dict[str, Any] = {}
                for name, ahead in (("sync", 0), ("async", 1)):
                    pair[name] = await arm(
                        client, engine, ahead=ahead, iterations=args.iterations,
                        train_s=train_s, version=version, start_iteration=iteration, args=args,
                    )
                    version = pair[name]["final_version"]
                    iteration = pair[name]["next_iteration"]
                pair["ratio"] = round(
                    pair["async"]["iterations_per_s"] / pair["sync"]["iterations_per_s"], 3
                )
                rounds.append(pair)
        finally:
            await client.aclose()
    finally:
        engine.close()
    ratios = [r["ratio"] for r in rounds]
    return {
        "bench": "async_refill",
        "iterations": args.iterations,
        "rounds": args.rounds,
        "samples_per_rollout": args.prompts * args.samples_per_prompt,
        "workers": args.workers,
        "first_rollout_s": round(first_s, 3),
        "generation_s": round(generation_s, 3),
        "train_s": round(train_s, 3),
        "max_staleness": args.max_staleness,
        "sync_iterations_per_s": [round(r["sync"]["iterations_per_s"], 4) for r in rounds],
        "async_iterations_per_s": [round(r["async"]["iterations_per_s"], 4) for r in rounds],
        "ratios": ratios,
        "async_vs_sync_ratio": statistics.median(ratios),
        "stale_tokens_loaded": sum(
            r[a]["stale_tokens_loaded"] for r in rounds for a in ("sync", "async")
        ),
        "unknown_version_tokens": sum(
            r[a]["unknown_version_tokens"] for r in rounds for a in ("sync", "async")
        ),
        "detail": rounds,
    }


def run_async_refill(
    *, iterations: int = 8, prompts: int = 8, samples_per_prompt: int = 2, workers: int = 1,
    train_s: float | None = None, max_staleness: int = 1, rounds: int = 1,
) -> dict[str, Any]:
    """Run both arms ``rounds`` times, alternating (see the module docstring), and return
    the figures; ``async_vs_sync_ratio`` is the median of the rounds' ratios."""
    args = argparse.Namespace(
        iterations=iterations, prompts=prompts, samples_per_prompt=samples_per_prompt,
        workers=workers, train_s=train_s, max_staleness=max_staleness, rounds=rounds,
    )
    with tempfile.TemporaryDirectory(prefix="async-refill-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/async_refill.py")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--train-s", type=float, default=None,
                        help="simulated trainer step (default: one rollout's generation time)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of arms, alternating; the ratio is the median")
    args = parser.parse_args()
    result = run_async_refill(
        iterations=args.iterations, prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt, workers=args.workers,
        train_s=args.train_s, max_staleness=args.max_staleness, rounds=args.rounds,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
