"""Staleness policies under async refill: how many long episodes reach the trainer.

The engine of ``bench/async_refill.py`` (a real redis-server, a tinylm server, a scheduler,
``--workers`` evaluator workers, a finalizer and a weight syncer, each its own process), with
the agent of ``bench/staleness_evaluators.py``: an episode runs as many turns as its task's
label, and the labels are drawn from a Pareto law (``--alpha``, at most ``--max-turns``), so
a few episodes are many times longer than the median one. The dataset holds exactly one
arm's prompts (``--iterations`` x ``--prompts``): every arm reads one shuffled epoch of it,
so every arm is offered the same episodes.

The trainer (this process) runs ``--iterations`` iterations of ``engine.client.RefillLoop``
per arm (a simulated step of ``--train-s`` seconds, by default the median generation time of
three warm-up rollouts of another dataset, then new weights published):

- ``sync``: ``ahead=0``, no bound -- the baseline;
- ``drop`` / ``keep`` / ``pace``: ``ahead=--ahead`` (async refill) with ``max_staleness =
  --max-staleness`` and that ``staleness_policy``.

A *long* episode is one of the top decile of length (turns) among the episodes the sync run
trained on: at least the 90th percentile of that distribution. A sample *reaches the trainer*
when it gives it a gradient (loaded, not a masked dummy, not a kept stale sample). Per arm:

- ``long_share``: the share of the long episodes offered (the same in every arm) that reach
  the trainer; ``<policy>_long_episode_share_ratio`` is it over the sync arm's;
- ``long_batch_share``: the share of long episodes among the samples that reach the trainer
  (the batch's composition); ``<policy>_long_batch_share_ratio`` is it over the sync arm's;
- ``loaded_long_share``: as ``long_share``, counting the stale samples ``keep`` loads without
  gradient;
- ``iterations_per_s``: iterations over the arm's wall time.

The last line is one JSON object: ``long_episode_share_ratio`` (the default policy's,
``engine.client.DEFAULT_STALENESS_POLICY``; it must be >= 0.8) and the per-policy keys.

    python bench/staleness.py [--iterations 8] [--prompts 8] [--max-staleness 1] [--ahead 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.async_refill import TIMINGS, write_weights  # noqa: E402
from engine.client import DEFAULT_STALENESS_POLICY, RefillLoop, RolloutClient  # noqa: E402
from engine.ops.embedded import start_redis_server  # noqa: E402
from engine.ops.processes import Processes  # noqa: E402
from engine.ops.tinylm import init_model  # noqa: E402
from engine.sample import Sample  # noqa: E402
from workers.cli import ROLLOUT  # noqa: E402

CONFIG = ROOT / "bench" / "staleness_evaluators.py"
POLICIES = ("drop", "keep", "pace")


def pareto_turns(n: int, *, alpha: float, max_turns: int, seed: int) -> list[int]:
    """``n`` episode lengths: ``ceil`` of a Pareto(``alpha``) draw of scale 1, capped."""
    rng = random.Random(seed)
    return [min(max_turns, int(rng.paretovariate(alpha) + 0.999)) for _ in range(n)]


class Engine:
    def __init__(self, tmp: Path, args: argparse.Namespace) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        init_model(self.model, seed=0, train_steps=0)
        self.redis = start_redis_server()
        self.procs = Processes(tmp, rollout=ROLLOUT, env={"PYTHONPATH": str(ROOT)}, settings={
            "redis_url": self.redis.url, **TIMINGS, "log_level": "WARNING"})
        url = self.procs.serve_tinylm("tinylm", self.model, "--weight-version", "0").url
        n = args.iterations * args.prompts
        self.turns = pareto_turns(n, alpha=args.alpha, max_turns=args.max_turns, seed=args.seed)
        rows = "".join(f'{{"prompt": "q{i}", "label": "{t}"}}\n' for i, t in enumerate(self.turns))
        (tmp / "episodes.jsonl").write_text(rows)
        warm = "".join(f'{{"prompt": "w{i}", "label": "3"}}\n' for i in range(4 * args.prompts))
        (tmp / "warm.jsonl").write_text(warm)
        (tmp / "rollout.yaml").write_text(
            "rollout:\n  datasets:\n"
            f"    episodes: {{path: {tmp / 'episodes.jsonl'}, task_type: turns}}\n"
            f"    warm: {{path: {tmp / 'warm.jsonl'}, task_type: turns}}\n"
        )
        self.procs.start("scheduler", "scheduler", "--rollout-config", str(tmp / "rollout.yaml"),
                         "--evaluator-config", str(CONFIG), "--scheduler-id", "bench")
        for w in range(args.workers):
            self.procs.start(f"worker{w}", "worker", "--evaluator-config", str(CONFIG),
                             "--worker-id", f"w{w}", "--sandbox", "none", "--quiet",
                             "--sglang-url", url)
        self.procs.start("finalizer", "finalizer", "--worker-id", "fin")
        self.procs.start("sync", "sync", "--worker-id", "sync", "--sglang-url", url)

    def close(self) -> None:
        self.procs.stop()
        self.redis.stop()


def length(sample: Sample) -> int:
    return int(str(sample.label))


def trained(sample: Sample) -> bool:
    """Whether the sample gives the trainer a gradient."""
    return not sample.remove_sample and not sample.stale and any(sample.loss_mask.tolist())


async def arm(
    client: RolloutClient, engine: Engine, args: argparse.Namespace, *, policy: str | None,
    version: int, iteration: int, train_s: float,
) -> dict[str, Any]:
    bound: dict[str, Any] = {}
    if policy is not None:
        bound = {"max_staleness": args.max_staleness, "staleness_policy": policy}
    loop = RefillLoop(
        client, ahead=0 if policy is None else args.ahead, version=version,
        start_iteration=iteration, timeout=600, n_prompts=args.prompts,
        n_samples_per_prompt=args.samples_per_prompt, datasets=["episodes"], **bound,
    )
    lengths: list[int] = []  # of the samples with a gradient
    loaded: list[int] = []  # of every sample loaded that is not a masked dummy
    n_stale = 0
    t0 = time.perf_counter()
    async for it in loop.iterations(args.iterations):
        engine.procs.check_alive()
        for s in it.samples:
            if s.remove_sample:
                continue
            loaded.append(length(s))
            if trained(s):
                lengths.append(length(s))
        n_stale += len(it.ready.stale_sample_ids)
        await asyncio.sleep(train_s)  # the simulated trainer step
        new = loop.version + 1
        weights = write_weights(engine.model, engine.tmp / "weights" / f"v{new}", seed=new)
        await loop.publish(new, str(weights))
    await client.wait_version_active(loop.version, timeout=120)
    wall = time.perf_counter() - t0
    return {
        "iterations_per_s": round(args.iterations / wall, 4),
        "wall_s": round(wall, 3),
        "lengths": lengths,
        "loaded": loaded,
        "n_trained": len(lengths),
        "n_loaded": len(loaded),
        "n_stale": n_stale,
        "final_version": loop.version,
        "next_iteration": loop._next,
    }


def n_long(lengths: list[int], threshold: int) -> int:
    return sum(1 for n in lengths if n >= threshold)


def share(lengths: list[int], threshold: int) -> float:
    return n_long(lengths, threshold) / len(lengths) if lengths else 0.0


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    engine = Engine(tmp, args)
    arms: dict[str, dict[str, Any]] = {}
    try:
        client = RolloutClient.connect(engine.redis.url, block_ms=200)
        try:
            timings = []
            for _ in range(4):  # the first one also waits for the processes to start
                t1 = time.perf_counter()
                rid = await client.request(iteration=0, n_prompts=args.prompts,
                                           n_samples_per_prompt=args.samples_per_prompt,
                                           datasets=["warm"])
                await client.wait_ready(rid, timeout=600)
                timings.append(time.perf_counter() - t1)
            train_s = args.train_s if args.train_s is not None else statistics.median(timings[1:])
            version, iteration = 0, 1
            for name in ("sync", *POLICIES):
                arms[name] = await arm(
                    client, engine, args, policy=None if name == "sync" else name,
                    version=version, iteration=iteration, train_s=train_s,
                )
                version = arms[name].pop("final_version")
                iteration = arms[name].pop("next_iteration")
        finally:
            await client.aclose()
    finally:
        engine.close()
    ordered = sorted(arms["sync"]["lengths"])
    threshold = ordered[int(0.9 * len(ordered))] if ordered else 1
    offered = n_long(engine.turns, threshold) * args.samples_per_prompt  # per arm
    figures = {
        name: {
            "long_share": n_long(a["lengths"], threshold) / offered if offered else 0.0,
            "long_batch_share": share(a["lengths"], threshold),
            "loaded_long_share": n_long(a["loaded"], threshold) / offered if offered else 0.0,
        }
        for name, a in arms.items()
    }
    sync = figures["sync"]
    out: dict[str, Any] = {
        "bench": "staleness",
        "iterations": args.iterations,
        "samples_per_rollout": args.prompts * args.samples_per_prompt,
        "ahead": args.ahead,
        "max_staleness": args.max_staleness,
        "train_s": round(train_s, 3),
        "turns_mean": round(statistics.mean(engine.turns), 3),
        "turns_max": max(engine.turns),
        "long_threshold_turns": threshold,
        "long_offered": offered,
        "default_policy": DEFAULT_STALENESS_POLICY,
    }
    for name in ("sync", *POLICIES):
        a, f = arms[name], figures[name]
        if name != "sync":
            for key, base in (("long_episode_share_ratio", "long_share"),
                              ("long_batch_share_ratio", "long_batch_share")):
                out[f"{name}_{key}"] = round(f[base] / sync[base], 3) if sync[base] else 0.0
        out[f"{name}_iterations_per_s"] = a["iterations_per_s"]
        for key, value in f.items():
            out[f"{name}_{key}"] = round(value, 4)
        out[f"{name}_trained"] = a["n_trained"]
        out[f"{name}_stale"] = a["n_stale"]
    out["long_episode_share_ratio"] = out[f"{DEFAULT_STALENESS_POLICY}_long_episode_share_ratio"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python bench/staleness.py")
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--ahead", type=int, default=2, help="rollouts requested ahead")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of the turns")
    parser.add_argument("--max-turns", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-s", type=float, default=None,
                        help="simulated trainer step (default: one rollout's generation time)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
