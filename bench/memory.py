"""Redis memory per stored token, and whether memory stays flat over many rollouts.

The stack of ``bench/rollout.py`` (a real redis-server, the scheduler, ``--workers``
evaluator worker processes and a finalizer; the zero-latency agent, 16 response tokens with
logprobs and a mask per sample, 8 samples per prompt; ``--prompt-tokens`` and
``--response-tokens`` change the lengths). The trainer (this process) requests
``--rollouts`` rollouts of ``--samples`` samples one after the other and loads each.

* **Bytes per stored token**: right after the first rollout is ready, ``MEMORY USAGE`` of its
  stream (every sample's events: task, start, turns, completion; the plan; the ready event)
  divided by its response tokens. The raw arrays alone are 9 bytes per token (int32 id,
  float32 logprob, uint8 mask); the rest is per-sample overhead, reported per sample.
* **Growth with retention on**: after every rollout this process runs one pass of
  ``rollout retention`` (``engine.ops.retention``) with ``--keep-s`` (default 0: a rollout is
  archived to a temporary file store and deleted as soon as it is loaded), then reads
  ``used_memory`` from ``INFO memory``. ``redis_memory_growth_ratio`` is the memory after the
  last rollout over the mean after rollouts 2..4 (the first warms up allocations). The
  pool (``rl:pool`` and its snapshot: retention snapshots the pool and trims the stream
  below the previous pass's snapshot, and ``AdmissionClosed`` lets the snapshot forget a
  finished rollout's batches) is reported beside it, with the same ratio without the pool;
  ``rl:data``, which retention does not touch (one small event per rollout), too.

    python bench/memory.py [--rollouts 40] [--samples 1024] [--workers 2]
    python bench/memory.py --rollouts 5 --samples 1024 --prompt-tokens 512 --response-tokens 1024
    python bench/memory.py --rollouts 5 --samples 1024 --prompt-tokens 512 --response-tokens 1024 \
        --token-offset 100000

``token_array_bytes_per_sample`` is what the token arrays hold (9 bytes per response token,
plus the prompt's 4-byte ids once per group when they are longer than 64 bytes, else once
per sample); ``stored_array_bytes_per_sample`` what their fields take on the wire (since
``SampleCompleted`` v3, ids and masks of 256 bytes or more in the compact form: masks as
bits, ids as 2 or 3 bytes); ``per_sample_overhead_bytes`` is the stream's bytes per sample
beyond the stored arrays. ``bytes_per_response_token`` depends on the response length.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rollout import PER_PROMPT, EngineArm  # noqa: E402
from engine.client import RolloutClient  # noqa: E402
from engine.events.base import Event  # noqa: E402
from engine.events.codec import array_fields, decode  # noqa: E402
from engine.events.redis_log import RedisEventLog  # noqa: E402
from engine.ops.retention import retention_pass  # noqa: E402

RAW_BYTES_PER_TOKEN = 4 + 4 + 1  # int32 id, float32 logprob, uint8 mask
BASELINE = slice(1, 4)  # rollouts 2..4


def _array_wire_bytes(event: Event, raw: bytes) -> int:
    """Bytes the event's token-array fields take on the wire (compact or raw)."""
    fields = array_fields(type(event))
    if not fields:
        return 0
    payload = msgpack.unpackb(raw, raw=False)
    return sum(len(payload[name]) for name, _kind, _compact in fields
               if isinstance(payload.get(name), bytes))


async def used_memory(log: RedisEventLog) -> int:
    info = await log.redis.info("memory")
    return int(info["used_memory"])


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp_dir:
        tmp = Path(tmp_dir)
        arm = EngineArm(args, tmp, env={
            "BENCH_PROMPT_TOKENS": str(args.prompt_tokens),
            "BENCH_RESPONSE_TOKENS": str(args.response_tokens),
            "BENCH_TOKEN_OFFSET": str(args.token_offset),
        })
        try:
            arm.start()
            arm.client = RolloutClient.connect(arm.redis.url, block_ms=1000)
            log = arm.client.log
            assert isinstance(log, RedisEventLog)
            store = tmp / "archive"
            memory: list[int] = []
            pool: list[int] = []  # rl:pool and its snapshot
            stream_bytes = 0
            stored_arrays = 0  # wire bytes of the token-array fields in the first stream
            by_type: dict[str, int] = {}  # encoded event bytes of the first rollout, by type
            samples_per_s: list[float] = []
            for i in range(args.rollouts):
                result = await arm.rollout(args.samples)
                samples_per_s.append(result["samples_per_s"])
                if i == 0:
                    stream = log.names.rollout(f"bench-{arm.seq}")
                    stream_bytes = await log.memory_usage(stream)
                    for _id, raw in await log.read_raw(stream):
                        event = decode(raw)
                        kind = event.type
                        by_type[kind] = by_type.get(kind, 0) + len(raw)
                        stored_arrays += _array_wire_bytes(event, raw)
                report = await retention_pass(log, store, keep_s=args.keep_s)
                if args.keep_s == 0 and len(report.archived) != 1:
                    raise RuntimeError(f"rollout {i + 1}: retention did {report.summary()}")
                memory.append(await used_memory(log))
                pool.append(await log.memory_usage(log.names.pool)
                            + await log.memory_usage(log.names.snapshot("pool")))
                print(
                    f"rollout {i + 1}/{args.rollouts}: used_memory {memory[-1]} B, "
                    f"{result['samples_per_s']:.0f} samples/s; {report.summary()}",
                    flush=True,
                )
            untouched = {
                name: await log.memory_usage(name)
                for name in (log.names.pool, log.names.snapshot("pool"), log.names.data)
            }
            archived_bytes = sum(p.stat().st_size for p in store.iterdir())
        finally:
            await arm.close()
    n_response = args.response_tokens
    tokens = args.samples * n_response
    baseline = statistics.mean(memory[BASELINE])
    rest = [m - p for m, p in zip(memory, pool, strict=True)]
    per_sample = stream_bytes / args.samples
    # The token arrays themselves: 9 bytes per response token, and the prompt's int32 ids
    # once per group when they are stored once (PromptStored), else once per sample.
    prompt_once = args.prompt_tokens * 4 > 64
    prompt_bytes = args.prompt_tokens * 4 / (PER_PROMPT if prompt_once else 1)
    arrays = n_response * RAW_BYTES_PER_TOKEN + prompt_bytes
    stored = stored_arrays / args.samples
    return {
        "rollouts": args.rollouts,
        "samples_per_rollout": args.samples,
        "response_tokens_per_sample": n_response,
        "prompt_tokens_per_sample": args.prompt_tokens,
        "samples_per_prompt": PER_PROMPT,
        "rollout_stream_bytes": stream_bytes,
        "bytes_per_sample": round(per_sample, 1),
        "token_array_bytes_per_sample": round(arrays, 1),
        "stored_array_bytes_per_sample": round(stored, 1),
        "per_sample_overhead_bytes": round(per_sample - stored, 1),
        "raw_bytes_per_response_token": RAW_BYTES_PER_TOKEN,
        "bytes_per_response_token": round(stream_bytes / tokens, 2),
        "used_memory_first": memory[0],
        "used_memory_baseline": round(baseline),
        "used_memory_last": memory[-1],
        "redis_memory_growth_ratio": round(memory[-1] / baseline, 3),
        "growth_ratio_without_pool": round(rest[-1] / statistics.mean(rest[BASELINE]), 3),
        "pool_bytes_first": pool[0],
        "pool_bytes_last": pool[-1],
        "pool_bytes_growth_per_rollout": round((pool[-1] - pool[0]) / (len(pool) - 1)),
        "control_plane_bytes": untouched,
        "event_bytes_per_sample": {
            kind: round(n / args.samples, 1) for kind, n in sorted(by_type.items())
        },
        "archive_bytes_per_sample": round(archived_bytes / (args.samples * args.rollouts), 1),
        "samples_per_s_median": round(statistics.median(samples_per_s)),
        "keep_s": args.keep_s,
        "token_offset": args.token_offset,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-batches", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=8,
                        help="prompt length of the bench agent (a group shares its prompt)")
    parser.add_argument("--response-tokens", type=int, default=16,
                        help="response length of the bench agent")
    parser.add_argument("--token-offset", type=int, default=0,
                        help="added to the response token ids (100000: ids of a large "
                        "vocabulary, which the compact form stores in 3 bytes, not 2)")
    parser.add_argument("--keep-s", type=float, default=0.0,
                        help="retention window of the pass run after each rollout")
    parser.add_argument("--play-scheduler", action="store_true",
                        help="drive scheduling from this process (what bench/rollout.py does "
                        "when workers.scheduler is missing)")
    args = parser.parse_args()
    if args.rollouts < 5:
        parser.error(f"--rollouts must be at least 5 (the baseline is rollouts 2..4), got "
                     f"{args.rollouts}")
    if args.samples < 8 or args.samples % 8:
        parser.error(f"--samples must be a positive multiple of 8, got {args.samples}")
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
