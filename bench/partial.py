"""Partial rollouts under heavy-tailed agent latencies: time to ready with over-provisioning.

A real redis-server and the engine's own processes (``workers.scheduler``, one
``workers.evaluator``, ``workers.finalizer``), started by ``bench/rollout.py``'s harness
(``EngineArm``). This file is also their evaluator config: its ``pareto`` agent sleeps a
Pareto-distributed time (``--alpha``, ``--scale`` seconds, capped at ``--cap``) drawn from the
request's seed and the sample's index, then answers as the zero-latency agent of
``bench/rollout.py`` does -- so what is measured is the tail, not a model.

Per round, two rollouts of the same ``--groups`` groups of ``--per-prompt`` samples, with the
same seed (so samples ``0 .. groups*per_prompt-1`` sleep the same in both):

* ``full``: waits for every sample of its groups (``overprovision=1.0``);
* ``partial``: plans ``ceil(groups * --overprovision)`` groups and is ready once ``groups``
  whole groups are done; the tail is aborted (``tail="abort"``).

Every sample of a rollout runs at once (batches of 1024, concurrency 1024), so time to ready is
set by the latencies. ``partial_vs_full_ratio`` = median full time / median partial time
(target >= 1.5). The last line printed is one JSON object.

    python bench/partial.py [--groups 32] [--per-prompt 4] [--overprovision 1.25] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rollout import EngineArm  # noqa: E402
from bench.rollout_evaluators import ZeroLatencyAgent  # noqa: E402
from engine.agents.base import AgentResult, BaseAgent, EpisodeContext  # noqa: E402
from engine.client import RolloutClient  # noqa: E402
from engine.domain import EvaluatorProfile, Resource, Task  # noqa: E402
from engine.events.catalog import planned_prompts  # noqa: E402

BATCH = 1024
TIMINGS = {"heartbeat_ms": 2000, "claim_idle_ms": 30000, "block_ms": 500}


# ---------------------------------------------------------------- the evaluator config


class ParetoAgent(ZeroLatencyAgent):
    """Sleeps ``scale * Pareto(alpha)`` seconds (at most ``cap``), seeded by the request's
    seed and the sample's index, then returns the zero-latency agent's 16-token trajectory
    (reward 1)."""

    def __init__(self, alpha: float, scale: float, cap: float) -> None:
        super().__init__(prompt_tokens=4)  # the 4-token prompt this bench has always used
        self.alpha, self.scale, self.cap = alpha, scale, cap

    def latency(self, sample_seed: int) -> float:
        draw = random.Random(sample_seed).paretovariate(self.alpha)
        return min(self.cap, self.scale * draw)

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        # context.seed is a function of the request's seed and the sample's index only
        await asyncio.sleep(self.latency(context.seed))
        return await super().run(task, context)


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="pareto",
            resource=Resource(concurrency=BATCH, cpu=float(BATCH)),
            run_resource=Resource(cpu=1.0),
            eval_resource=Resource(cpu=1.0),
            batch_size=BATCH,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    env = os.environ
    return {
        "pareto": ParetoAgent(
            float(env.get("PARTIAL_BENCH_ALPHA", "1.5")),
            float(env.get("PARTIAL_BENCH_SCALE", "0.05")),
            float(env.get("PARTIAL_BENCH_CAP", "5.0")),
        )
    }


# ---------------------------------------------------------------- the bench


class Engine(EngineArm):
    """redis-server, scheduler, one worker and a finalizer, as processes."""

    def __init__(self, tmp: Path, env: dict[str, str], n_prompts: int) -> None:
        super().__init__(argparse.Namespace(play_scheduler=False), tmp, env=env, timings=TIMINGS)
        data = tmp / "prompts.jsonl"
        rows = (f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(n_prompts))
        data.write_text("".join(rows))
        (tmp / "rollout.yaml").write_text(
            f"rollout:\n  datasets:\n    bench: {{path: {data}, task_type: pareto}}\n"
        )
        layout = '{"node-a": {"gpus": [0], "cpu": 100000, "memory_gb": 100000}}'
        config = str(Path(__file__).resolve())
        self.spawn("scheduler", "scheduler", "--rollout-config", str(tmp / "rollout.yaml"),
                   "--evaluator-config", config, "--cluster-layout", layout,
                   "--scheduler-id", "bench", "--log-level", "WARNING")
        self.spawn("worker", "worker", "--evaluator-config", config,
                   "--worker-id", "w0", "--sandbox", "none", "--quiet", "--log-level", "WARNING")
        self.spawn("finalizer", "finalizer", "--worker-id", "fin",
                   "--log-level", "WARNING")


async def _time_to_ready(
    client: RolloutClient, rid: str, seed: int, groups: int, per_prompt: int, over: float
) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    await client.request(
        iteration=seed, n_prompts=groups, n_samples_per_prompt=per_prompt, seed=seed,
        rollout_id=rid, overprovision=over, tail="abort",
    )
    ready = await client.wait_ready(rid, timeout=600)
    wall = time.perf_counter() - t0
    kept = len(ready.sample_ids) + len(ready.dropped_sample_ids)
    if kept != groups * per_prompt:
        raise RuntimeError(f"{rid}: {kept} samples in the ready groups, not {groups * per_prompt}")
    return wall, {"kept": kept, "tail": len(ready.tail_sample_ids)}


async def _rounds(
    url: str, rounds: int, groups: int, per_prompt: int, over: float
) -> dict[str, list[float]]:
    client = RolloutClient.connect(url, block_ms=500)
    out: dict[str, list[float]] = {"full": [], "partial": [], "tail": []}
    try:
        # warm-up (not measured): every process has started and served one rollout
        await _time_to_ready(client, "warmup", 1, 1, per_prompt, 1.0)
        for r in range(rounds):
            seed = 1000 + r
            arms = [("full", 1.0), ("partial", over)]
            timed: dict[str, float] = {}
            for name, factor in arms if r % 2 == 0 else arms[::-1]:  # alternate the order
                timed[name], info = await _time_to_ready(
                    client, f"{name}-{r}", seed, groups, per_prompt, factor
                )
                if name == "partial":
                    out["tail"].append(float(info["tail"]))
            full, part = timed["full"], timed["partial"]
            out["full"].append(full)
            out["partial"].append(part)
    finally:
        await client.aclose()
    return out


def run_partial(
    *,
    groups: int = 32,
    per_prompt: int = 4,
    overprovision: float = 1.25,
    rounds: int = 3,
    alpha: float = 1.5,
    scale: float = 0.05,
    cap: float = 5.0,
) -> dict[str, Any]:
    """Run the bench (see the module docstring); returns its figures."""
    n_planned = planned_prompts(groups, overprovision)
    env = {
        "PARTIAL_BENCH_ALPHA": str(alpha),
        "PARTIAL_BENCH_SCALE": str(scale),
        "PARTIAL_BENCH_CAP": str(cap),
    }
    with tempfile.TemporaryDirectory(prefix="partial-bench-") as tmp:
        engine = Engine(Path(tmp), env, n_prompts=max(n_planned, groups) * 2 * rounds)
        try:
            times = asyncio.run(_rounds(engine.redis.url, rounds, groups, per_prompt,
                                        overprovision))
        finally:
            asyncio.run(engine.close())
    full = statistics.median(times["full"])
    partial = statistics.median(times["partial"])
    return {
        "bench": "partial",
        "groups": groups,
        "per_prompt": per_prompt,
        "overprovision": overprovision,
        "rounds": rounds,
        "pareto_alpha": alpha,
        "pareto_scale_s": scale,
        "latency_cap_s": cap,
        "full_time_to_ready_s": round(full, 3),
        "partial_time_to_ready_s": round(partial, 3),
        "full_s_by_round": [round(t, 3) for t in times["full"]],
        "partial_s_by_round": [round(t, 3) for t in times["partial"]],
        "tail_samples_by_round": [int(t) for t in times["tail"]],
        "partial_vs_full_ratio": round(full / partial, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--per-prompt", type=int, default=4)
    parser.add_argument("--overprovision", type=float, default=1.25)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=1.5)
    parser.add_argument("--scale", type=float, default=0.05)
    parser.add_argument("--cap", type=float, default=5.0)
    args = parser.parse_args(argv)
    result = run_partial(
        groups=args.groups, per_prompt=args.per_prompt, overprovision=args.overprovision,
        rounds=args.rounds, alpha=args.alpha, scale=args.scale, cap=args.cap,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
