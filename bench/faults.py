"""Fault injection at scale: many seeds of the scenario of ``tests/faults/harness.py``.

Each seed runs 1 scheduler, 3 evaluator workers and 1 finalizer (the engine's launcher) on a
real redis-server with AOF, a 2-node layout of 6 placement tokens each, and several rollouts,
while it SIGKILLs a busy worker, the scheduler and the finalizer, SIGTERMs a busy worker,
restarts redis-server twice and appends garbage to the control, work, rollout and pool
streams (the order and timing drawn from the seed). ``--long-outage-s`` keeps the second
restart down that long (e.g. 35: past every claim window and the 30 s backoff cap).

    PYTHONPATH=$PWD python bench/faults.py [--seeds 1-8] [--rollouts 3] [--prompts 24]
        [--samples 4] [--sleep-s 0.3] [--long-outage-s 0]

Per seed one line of figures; the last line printed is one JSON object with the totals:
rollouts completed (of requested), redundant attempts (runs beyond one per sample; every one
is a run a SIGKILL cut), peak over-commit (the most samples the agent saw running at once on
a node, minus its tokens: <= 0 means never over-committed), dead-letter copies (letters
beyond one per garbage entry) and violated checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.faults.harness import Report, Workload, run_scenario  # noqa: E402


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    workload = Workload(
        rollouts=args.rollouts,
        prompts=args.prompts,
        samples_per_prompt=args.samples,
        sleep_s=args.sleep_s,
        timeout_s=args.timeout_s,
        long_outage_s=args.long_outage_s,
    )
    reports: list[Report] = []
    for seed in _seeds(args.seeds):
        report = await run_scenario(seed, workload)
        reports.append(report)
        print(json.dumps(report.figures()), flush=True)
        for line in report.violations:
            print(f"  seed {seed}: {line}", flush=True)
    return {
        "seeds": len(reports),
        "workload": {"rollouts": args.rollouts, "prompts": args.prompts,
                     "samples_per_prompt": args.samples, "sleep_s": args.sleep_s,
                     "long_outage_s": args.long_outage_s},
        "rollouts_requested": sum(r.rollouts_requested for r in reports),
        "rollouts_completed": sum(r.rollouts_completed for r in reports),
        "samples": sum(r.samples for r in reports),
        "redundant_attempts": sum(r.redundant_attempts for r in reports),
        "peak_overcommit": max(r.peak_overcommit for r in reports),
        "garbage_entries": sum(r.garbage for r in reports),
        "dead_letter_copies": sum(r.dead_letter_copies for r in reports),
        "violations": sum(len(r.violations) for r in reports),
        "wall_s": round(sum(r.wall_s for r in reports), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", default="1-8", help="seeds: 1-8 or 1,3,5")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--sleep-s", type=float, default=0.3, help="agent's base episode time")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--long-outage-s", type=float, default=0.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
