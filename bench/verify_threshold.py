"""Per-token |delta logprob| of re-scoring real multi-turn rollouts: what the verification
boundary's threshold (``engine.actors.verify.DEFAULT_THRESHOLD``) is chosen from.

Reads the rollout archives a demo wrote (``rollout demo --workdir W`` leaves them in
``W/archives``), serves the demo's model (``W/tinylm``) with the engine's launcher, and
re-scores every completed sample as the boundary does: one prefill of ``prompt + response``,
the recorded logprob of each sampled token (loss mask 1) against the re-scored one. The demo's
own ``SampleVerified`` events (it re-scores every sample on the very server that sampled them)
are summarised beside, when the archives hold them.

    python bench/verify_threshold.py --workdir runs/verify-demo

The last line printed is one JSON object: token count, quantiles, the max, how many tokens
exceed a few candidate thresholds, and the demo's own per-sample maxima.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.events import SampleCompleted, SampleVerified
from engine.ops.processes import Processes
from engine.ops.replay import decode_entries, read_archive
from workers.cli import ROLLOUT

CANDIDATES = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)


def load(archives: Path) -> tuple[list[SampleCompleted], list[SampleVerified]]:
    completed: list[SampleCompleted] = []
    verified: list[SampleVerified] = []
    for path in sorted(archives.glob("*.rollout")):
        archive = read_archive(path)
        envs, _ = decode_entries(archive.stream, archive.entries)
        for env in envs:
            if isinstance(env.event, SampleCompleted):
                completed.append(env.event)
            elif isinstance(env.event, SampleVerified):
                verified.append(env.event)
    return completed, verified


async def deltas(url: str, samples: list[SampleCompleted]) -> tuple[np.ndarray, list[int]]:
    backend = SGLangBackend(config=SGLangConfig(url=url))
    out: list[float] = []
    turns: list[int] = []
    try:
        for s in samples:
            mask = s.loss_mask.numpy().astype(bool)
            if not mask.any():
                continue
            score = await backend.score(
                s.prompt_ids.numpy().tolist(), s.response_ids.numpy().tolist()
            )
            recorded = s.logprobs.numpy().astype(np.float64)
            rescored = np.asarray(score.logprobs, dtype=np.float64)
            out.extend(np.abs(recorded - rescored)[mask].tolist())
            turns.append(s.n_turns)
    finally:
        await backend.aclose()
    return np.asarray(out), turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="a demo's --workdir")
    args = parser.parse_args()
    completed, verified = load(args.workdir / "archives")
    if not completed:
        raise SystemExit(f"no completed samples in {args.workdir / 'archives'}")
    with Processes(args.workdir / "logs", rollout=ROLLOUT) as procs:
        server = procs.serve_tinylm("tinylm-verify", args.workdir / "tinylm")
        d, turns = asyncio.run(deltas(server.url, completed))
    figures: dict[str, Any] = {
        "bench": "verify_threshold",
        "samples": len(turns),
        "multi_turn_samples": sum(1 for t in turns if t > 1),
        "turns_max": max(turns) if turns else 0,
        "tokens": int(d.size),
        "p50": float(np.quantile(d, 0.5)),
        "p99": float(np.quantile(d, 0.99)),
        "p999": float(np.quantile(d, 0.999)),
        "max": float(d.max()),
        "tokens_above": {f"{c:g}": int((d > c).sum()) for c in CANDIDATES},
    }
    checked = [v for v in verified if not v.skipped]
    if verified:
        maxima = np.asarray([v.max_abs_delta for v in checked]) if checked else np.zeros(0)
        figures["demo_checks"] = {
            "selected": len(verified),
            "checked": len(checked),
            "tokens": sum(v.n_tokens for v in checked),
            "sample_max_p50": float(np.quantile(maxima, 0.5)) if checked else None,
            "sample_max_max": float(maxima.max()) if checked else None,
        }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
