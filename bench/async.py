"""Issue 12's bench: the training loop with async refill, and partial rollouts.

Two parts, each a bench of its own that this script runs in turn (same session, same
machine) and whose figures it joins:

(a) ``bench/async_refill.py``: a training loop whose simulated trainer step takes about the
    generation time, synchronous (request, wait, train, publish) vs async refill (rollout N+1
    generates while the trainer trains on N; the weight syncer lands each publication at the
    turn boundaries of in-flight trajectories). ``async_vs_sync_ratio`` is iterations/s of the
    async loop over the synchronous one (target >= 1.6), with the staleness bound respected:
    ``stale_tokens_loaded`` (sampled tokens loaded from a version more than ``max_staleness``
    behind the trainer's) must be 0.
(b) ``bench/partial.py``: heavy-tailed (Pareto) agent latencies; time to ``RolloutReady`` with
    1.25x over-provisioning (ready once the needed whole groups are complete, the tail aborted)
    vs waiting for every sample of the same number of groups: ``partial_vs_full_ratio``
    (target >= 1.5).

    python bench/async.py [--refill-rounds 3] [--refill-iterations 32] [--refill-prompts 32]
                          [--partial-rounds 3]

The last line printed is one JSON object with both parts' figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent


def _load(name: str) -> ModuleType:
    """Import a sibling bench file as a module (``bench/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refill-rounds", type=int, default=3)
    parser.add_argument("--refill-iterations", type=int, default=32)
    parser.add_argument("--refill-prompts", type=int, default=32)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--partial-rounds", type=int, default=3)
    parser.add_argument("--partial-groups", type=int, default=32)
    parser.add_argument("--overprovision", type=float, default=1.25)
    args = parser.parse_args(argv)

    refill: dict[str, Any] = _load("async_refill").run_async_refill(
        iterations=args.refill_iterations, prompts=args.refill_prompts,
        max_staleness=args.max_staleness, rounds=args.refill_rounds,
    )
    print(json.dumps({"part": "async_refill", **refill}), flush=True)
    partial: dict[str, Any] = _load("partial").run_partial(
        groups=args.partial_groups, overprovision=args.overprovision, rounds=args.partial_rounds,
    )
    print(json.dumps({"part": "partial", **partial}), flush=True)
    print(json.dumps({
        "bench": "async",
        "async_vs_sync_ratio": refill["async_vs_sync_ratio"],
        "stale_tokens_loaded": refill["stale_tokens_loaded"],
        "max_staleness": args.max_staleness,
        "refill_rounds": args.refill_rounds,
        "refill_iterations": args.refill_iterations,
        "partial_vs_full_ratio": partial["partial_vs_full_ratio"],
        "full_time_to_ready_s": partial["full_time_to_ready_s"],
        "partial_time_to_ready_s": partial["partial_time_to_ready_s"],
        "overprovision": args.overprovision,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
