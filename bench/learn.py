"""Does the student learn? The reference trainer (``python -m trainer``) for a CPU budget.

    PYTHONPATH=$PWD python bench/learn.py --algorithm grpo --iterations 20
    PYTHONPATH=$PWD python bench/learn.py --algorithm opd --iterations 20
    PYTHONPATH=$PWD python bench/learn.py --algorithm mixed --iterations 40 --dagger-beta 0.5

Every ``python -m trainer`` flag is accepted (``--student-steps``, ``--teacher-steps``, ``--lr``,
``--prompts``, ``--eval-every`` ...); the workdir defaults to ``runs/bench-learn-<algorithm>``,
where ``metrics.jsonl`` and ``curves.png`` stay. Models are built once into ``--models-dir``
(default ``runs/train-models``) and reused, and their build is not in ``wall_s``.

Last line, JSON: ``algorithm``, ``iterations``, ``eval_reward_first`` (before the first
update), ``eval_reward_last`` (after the last), ``teacher_eval_reward`` (None for grpo without
``--teacher-eval``), ``wall_s`` (training, evals included), then the training-rollout
reward and KL of the first and last iterations and their means over the first and last
four iterations (single iterations alternate between the math and shell datasets), every
eval reward, the CPU seconds of the bench and every process
it started (``cpu_s``: on a shared machine wall time says little), the mean seconds per
iteration and the load average before and after.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

from trainer.cli import build_parser, run, stop_on_signals
from trainer.report import read_rows


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def window_means(rows: list[dict[str, Any]], key: str, n: int = 4) -> tuple[Any, Any]:
    """Mean of ``key`` over the first and the last ``n`` training iterations: single
    iterations alternate between datasets (FIFO) and are noisy."""
    values = [float(r[key]) for r in rows if key in r and "train_s" in r]
    return _mean(values[:n]), _mean(values[-n:])


def main() -> int:
    parser = build_parser()
    parser.prog = "bench/learn.py"
    args = parser.parse_args()
    if args.workdir is None:
        args.workdir = Path(f"runs/bench-learn-{args.algorithm}")
    stop_on_signals()
    load_before = os.getloadavg()[0]
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    summary = run(args)
    total_wall = time.monotonic() - t0
    rows = read_rows(Path(summary["metrics"]))
    iters = [r for r in rows if "train_s" in r]
    per_iter = (
        sum(r["eval_s"] + r["rollout_s"] + r["train_s"] + r["publish_s"] for r in iters)
        / len(iters) if iters else None
    )
    kl_head, kl_tail = window_means(rows, "kl")
    reward_head, reward_tail = window_means(rows, "reward")
    out = {
        "algorithm": summary["algorithm"],
        "iterations": summary["iterations"],
        "eval_reward_first": summary["eval_reward_first"],
        "eval_reward_last": summary["eval_reward_last"],
        "teacher_eval_reward": summary["teacher_eval_reward"],
        "wall_s": summary["wall_s"],
        "train_reward_first": summary["train_reward_first"],
        "train_reward_last": summary["train_reward_last"],
        "kl_first": summary["kl_first"],
        "kl_last": summary["kl_last"],
        "kl_mean_first_4": kl_head,
        "kl_mean_last_4": kl_tail,
        "train_reward_mean_first_4": reward_head,
        "train_reward_mean_last_4": reward_tail,
        "eval_rewards": [round(r["eval_reward"], 4) for r in rows if "eval_reward" in r],
        "seconds_per_iteration": round(per_iter, 2) if per_iter is not None else None,
        "cpu_s": round(_cpu_s() - cpu0, 1),
        "total_wall_s": round(total_wall, 1),
        "loadavg_before": round(load_before, 2),
        "loadavg_after": round(os.getloadavg()[0], 2),
        "student": summary["student"],
        "metrics": summary["metrics"],
        "plot": summary["plot"],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
