"""Per-iteration metrics (``metrics.jsonl``) and a plot of reward and KL (``curves.png``).

``MetricsWriter`` appends one JSON object per line and flushes it, so a run that is stopped
keeps every finished iteration. ``plot`` draws, from those rows, the training reward, the eval
reward (where measured, with the teacher's as a line when known) and the KL per iteration
(and, for the mixed lane, the CE on the teacher's tokens);
it needs matplotlib (``pip install 'rollout-engine[train]'``), and says so instead of failing
the run when it is missing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["MetricsWriter", "main", "plot", "read_rows"]


class MetricsWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] = open(path, "w")  # closed in close()

    def write(self, row: dict[str, Any]) -> None:
        self._fh.write(json.dumps(row, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(
    rows: Sequence[dict[str, Any]], out: Path, *, title: str,
    teacher_eval_reward: float | None = None, kl_label: str = "KL (K3)",
) -> Path | None:
    """Write the curves to ``out`` (PNG); None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    datasets = sorted({k for r in rows for k in r if k.startswith("reward/")})
    for key in datasets:  # one line per dataset: the FIFO data path alternates them
        train = [(r["iteration"], r[key]) for r in rows if key in r]
        top.plot(*zip(*train, strict=True), ".-", label=f"train {key}", alpha=0.5)
    evals = [(r["iteration"], r["eval_reward"]) for r in rows if "eval_reward" in r]
    if evals:
        top.plot(*zip(*evals, strict=True), "o-", label="eval reward (student)")
    if teacher_eval_reward is not None:
        top.axhline(teacher_eval_reward, color="grey", linestyle="--",
                    label="eval reward (teacher)")
    top.set_ylabel("mean reward")
    top.set_ylim(-0.05, 1.05)
    top.legend(loc="best", fontsize=8)
    top.set_title(title)
    kl = [(r["iteration"], r["kl"]) for r in rows if "kl" in r]
    if kl:
        bottom.plot(*zip(*kl, strict=True), color="tab:red", label=kl_label)
    ce = [(r["iteration"], r["ce"]) for r in rows if "ce" in r]
    if ce:  # the mixed lane: CE on the teacher's tokens
        bottom.plot(*zip(*ce, strict=True), color="tab:purple",
                    label="CE on teacher tokens (nats/token)")
    if kl or ce:
        bottom.legend(loc="best", fontsize=8)
    bottom.set_xlabel("iteration")
    bottom.set_ylabel("KL / CE" if ce else "KL")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer.report METRICS.jsonl OUT.png``: plot a run's metrics again."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer.report")
    p.add_argument("metrics", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--title", default="")
    p.add_argument("--teacher-eval-reward", type=float, default=None)
    args = p.parse_args(argv)
    done = plot(read_rows(args.metrics), args.out, title=args.title or str(args.metrics),
                teacher_eval_reward=args.teacher_eval_reward)
    if done is None:
        print("matplotlib is missing: pip install 'rollout-engine[train]'")
        return 1
    print(done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
