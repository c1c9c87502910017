"""Collation: ``engine.client.collate`` (packed arrays, one numpy array per batch field, one
``torch.from_numpy`` each) beside the per-row method it replaced (tuples of Python numbers,
one ``torch.tensor`` per row and field), on the same samples, in the same process.

    python bench/collate.py [--batch 256] [--prompt 512] [--response 2048] [--rounds 7]

Both arms must build identical tensors (checked before timing). Rounds are interleaved so
machine noise hits both alike; figures are medians. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from engine.client import collate
from engine.projections.samples import scalar_reward
from engine.sample import Sample


def make_samples(batch: int, prompt: int, response: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(batch):
        p = int(rng.integers(prompt // 2, prompt + 1))
        r = int(rng.integers(1, response + 1))
        out.append(
            Sample(
                index=i,
                group_index=i // 8,
                tokens=rng.integers(0, 150_000, p + r, dtype=np.int32),
                response_length=r,
                loss_mask=rng.integers(0, 2, r, dtype=np.uint8),
                rollout_log_probs=-rng.random(r, dtype=np.float32),
                teacher_log_probs=-rng.random(r, dtype=np.float32),
                reward=float(rng.random()),
            )
        )
    return out


def as_rows(samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """What the per-row method had to work with: tuples of Python numbers per sample."""
    return [
        {
            "tokens": tuple(s.tokens.tolist()),
            "response_length": s.response_length,
            "loss_mask": tuple(s.loss_mask.tolist()),
            "rollout_log_probs": (
                tuple(s.rollout_log_probs.tolist()) if s.rollout_log_probs is not None else None
            ),
            "teacher_log_probs": (
                tuple(s.teacher_log_probs.tolist()) if s.teacher_log_probs is not None else None
            ),
            "reward": s.reward,
            "remove_sample": s.remove_sample,
        }
        for s in samples
    ]


def per_row_collate(rows: Sequence[dict[str, Any]], pad: int = 0) -> dict[str, torch.Tensor]:
    """The method ``collate`` used before: a ``torch.tensor`` per row and field."""
    batch = len(rows)
    width = max(len(r["tokens"]) for r in rows)
    tokens = torch.full((batch, width), pad, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    with_teacher = all(r["teacher_log_probs"] is not None for r in rows)
    teacher = torch.zeros((batch, width), dtype=torch.float32) if with_teacher else None
    for i, r in enumerate(rows):
        n = len(r["tokens"])
        start = n - r["response_length"]
        tokens[i, :n] = torch.tensor(r["tokens"], dtype=torch.long)
        attention[i, :n] = 1
        if r["response_length"]:
            loss_mask[i, start:n] = torch.tensor(r["loss_mask"], dtype=torch.float32)
            if r["rollout_log_probs"] is not None:
                logprobs[i, start:n] = torch.tensor(r["rollout_log_probs"], dtype=torch.float32)
            if teacher is not None:
                teacher[i, start:n] = torch.tensor(r["teacher_log_probs"], dtype=torch.float32)
    out = {
        "tokens": tokens,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "rollout_log_probs": logprobs,
        "rewards": torch.tensor([scalar_reward(r["reward"]) for r in rows], dtype=torch.float32),
        "response_lengths": torch.tensor([r["response_length"] for r in rows], dtype=torch.long),
        "prompt_lengths": torch.tensor(
            [len(r["tokens"]) - r["response_length"] for r in rows], dtype=torch.long
        ),
        "remove_sample": torch.tensor([r["remove_sample"] for r in rows], dtype=torch.bool),
    }
    if teacher is not None:
        out["teacher_log_probs"] = teacher
    return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)

    samples = make_samples(args.batch, args.prompt, args.response)
    rows = as_rows(samples)
    new, old = collate(samples), per_row_collate(rows)
    assert new.keys() == old.keys()
    for key in new:
        assert new[key].dtype == old[key].dtype and torch.equal(new[key], old[key]), key

    new_s: list[float] = []
    old_s: list[float] = []
    for _ in range(args.rounds):
        new_s.append(timed(lambda: collate(samples)))
        old_s.append(timed(lambda: per_row_collate(rows)))
    new_med, old_med = statistics.median(new_s), statistics.median(old_s)
    n_tokens = sum(len(s.tokens) for s in samples)
    result = {
        "bench": "collate",
        "batch": args.batch,
        "tokens": n_tokens,
        "rounds": args.rounds,
        "collate_s": round(new_med, 6),
        "per_row_s": round(old_med, 6),
        "collate_samples_per_s": round(args.batch / new_med, 1),
        "per_row_samples_per_s": round(args.batch / old_med, 1),
        "speedup": round(old_med / new_med, 2),
    }
    print(
        f"collate {args.batch} samples ({n_tokens} tokens): packed {new_med * 1e3:.2f} ms, "
        f"per-row {old_med * 1e3:.2f} ms, {result['speedup']}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
