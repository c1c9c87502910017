"""Codec CPU per event: the compact array form beside the raw form.

Arms (microseconds of process CPU per event, the best of interleaved rounds):
  encode / encode_raw      ``encode`` of a SampleCompleted (compact arrays) and of the same
                           values in a class without ``compact_arrays`` (every array raw)
  decode / decode_raw      ``decode`` of those bytes (the compiled path; compact arrays lazy)
  decode_reference         the msgpack + pydantic reference decoder, compact bytes
  fold_decode              ``decode`` + what a fold reads of a sample (the lengths of its
                           ids, its loss mask's bytes)
  decode_expand            ``decode`` + every array's values (``numpy()``)
Ratios: ``encode_vs_raw`` and ``decode_vs_raw`` (compact / raw CPU; 1.0: no extra cost).

    python bench/codec.py [--events 5000] [--tokens 256] [--prompt 64] [--rounds 7]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np

from engine.events import SampleCompleted, decode, encode
from engine.events.codec import decode_reference


class RawSample(SampleCompleted):
    """A SampleCompleted whose arrays all travel raw (the form before compaction)."""

    compact_arrays: ClassVar[frozenset[str]] = frozenset()
    type: Literal["BenchRawSample"] = "BenchRawSample"  # type: ignore[assignment]


def make_events(n: int, tokens: int, prompt: int, cls: type[SampleCompleted]) -> list[Any]:
    rng = np.random.default_rng(0)
    return [
        cls(
            rollout_id="bench",
            sample_id=f"s{i}",
            prompt_ids=rng.integers(0, 150_000, prompt, dtype=np.int32),
            response_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            loss_mask=(rng.random(tokens) < 0.9).astype(np.uint8),
            reward=1.0,
            producer="bench",
        )
        for i in range(n)
    ]


def fold_decode(raw: bytes) -> tuple[int, int, bytes]:
    ev = decode(raw)
    assert isinstance(ev, SampleCompleted)
    return len(ev.prompt_ids), len(ev.response_ids), ev.loss_mask.data


def decode_expand(raw: bytes) -> None:
    ev = decode(raw)
    assert isinstance(ev, SampleCompleted)
    for name in (
        "prompt_ids",
        "response_ids",
        "logprobs",
        "loss_mask",
        "token_versions",
        "teacher_mask",
    ):
        getattr(ev, name).numpy()


def run(args: argparse.Namespace) -> dict[str, object]:
    compact = make_events(args.events, args.tokens, args.prompt, SampleCompleted)
    raw_form = make_events(args.events, args.tokens, args.prompt, RawSample)
    blobs = [encode(e) for e in compact]
    raw_blobs = [encode(e) for e in raw_form]
    arms: dict[str, Callable[[], object]] = {
        "encode": lambda: [encode(e) for e in compact],
        "encode_raw": lambda: [encode(e) for e in raw_form],
        "decode": lambda: [decode(b) for b in blobs],
        "decode_raw": lambda: [decode(b) for b in raw_blobs],
        "decode_reference": lambda: [decode_reference(b) for b in blobs],
        "fold_decode": lambda: [fold_decode(b) for b in blobs],
        "decode_expand": lambda: list(map(decode_expand, blobs)),
    }
    gc.collect()
    gc.freeze()  # the inputs are not the arms' garbage: collections skip them
    best = {name: float("inf") for name in arms}
    for _round in range(args.rounds):
        for name, fn in arms.items():
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    us = {name: round(t / args.events * 1e6, 3) for name, t in best.items()}
    out: dict[str, object] = {
        "events": args.events,
        "tokens_per_event": args.tokens,
        "prompt_tokens": args.prompt,
        "event_bytes": len(blobs[0]),
        "event_bytes_raw": len(raw_blobs[0]),
        **{f"{name}_us": value for name, value in us.items()},
        "encode_vs_raw": round(us["encode"] / us["encode_raw"], 3),
        "decode_vs_raw": round(us["decode"] / us["decode_raw"], 3),
    }
    for name, value in us.items():
        print(f"{name:18s} {value:8.3f} us/event")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
