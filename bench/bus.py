"""Event-bus throughput: the engine's log beside raw redis-py on the same server, same bytes.

Arms (each measured in interleaved rounds so machine noise hits both sides alike):
  append_batched  EventLog.append_many (encode + pipelined XADD)  vs raw pipelined XADD
  append_single   EventLog.append (encode + XADD)                 vs raw XADD
  read_decode     EventLog.read (XRANGE + decode + validate)      vs raw XRANGE
  cas             EventLog.append_if_last (Lua compare-and-append) vs raw XADD
plus `redis-benchmark` XADD (pipelined) when the binary is present, as an outside reference.

    python bench/bus.py [--events 20000] [--tokens 256] [--rounds 5]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable

import numpy as np

from engine.events import SampleCompleted, encode
from engine.events.redis_log import RedisEventLog, RedisSettings, connect
from engine.ops.embedded import start_redis


def make_events(n: int, tokens: int) -> list[SampleCompleted]:
    rng = np.random.default_rng(0)
    return [
        SampleCompleted(
            rollout_id="bench",
            sample_id=f"s{i}",
            prompt_ids=rng.integers(0, 150_000, 64, dtype=np.int32),
            response_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32),
            loss_mask=np.ones(tokens, np.uint8),
            reward=1.0,
            producer="bench",
        )
        for i in range(n)
    ]


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def run(args: argparse.Namespace) -> dict[str, object]:
    server = start_redis()
    settings = RedisSettings(url=server.url)
    client = connect(settings)
    if args.python_parser:
        # redis-py's pure-Python reply parser (its default when hiredis is not installed)
        from redis._parsers import _AsyncRESP2Parser

        client.connection_pool.connection_kwargs["parser_class"] = _AsyncRESP2Parser
    raw: object = client
    log = RedisEventLog(client, producer="bench")
    events = make_events(args.events, args.tokens)
    blobs = [encode(e) for e in events]
    n = len(events)
    chunk = 500
    results: dict[str, list[tuple[float, float]]] = {
        "append_batched": [], "append_single": [], "read_decode": [], "cas": []
    }

    async def engine_batched() -> None:
        for i in range(0, n, chunk):
            await log.append_many([("b:eng", e) for e in events[i : i + chunk]])

    async def raw_batched() -> None:
        for i in range(0, n, chunk):
            async with client.pipeline(transaction=False) as pipe:
                for b in blobs[i : i + chunk]:
                    pipe.xadd("b:raw", {b"e": b})
                await pipe.execute()

    single_n = min(n, 3000)

    async def engine_single() -> None:
        for e in events[:single_n]:
            await log.append("s:eng", e)

    async def raw_single() -> None:
        for b in blobs[:single_n]:
            await client.xadd("s:raw", {b"e": b})

    async def engine_read() -> None:
        got = await log.read_all("b:eng", page=1000)
        assert len(got) >= n

    async def raw_read() -> None:
        cursor = "-"
        total = 0
        while True:
            rows = await client.xrange("b:raw", cursor, "+", count=1000)
            total += len(rows)
            if len(rows) < 1000:
                break
            cursor = "(" + rows[-1][0].decode()
        assert total >= n

    async def engine_cas() -> None:
        last = await log.last_id("c:eng")
        for e in events[:single_n]:
            last = (await log.append_if_last("c:eng", e, last))[0]

    async def raw_cas_baseline() -> None:
        for b in blobs[:single_n]:
            await client.xadd("c:raw", {b"e": b})

    del raw
    for _round in range(args.rounds):
        await client.flushall()
        # append arms fill the streams the read arms then read
        eng, rw = await timed(engine_batched), await timed(raw_batched)
        results["append_batched"].append((n / eng, n / rw))
        eng, rw = await timed(engine_single), await timed(raw_single)
        results["append_single"].append((single_n / eng, single_n / rw))
        rw, eng = await timed(raw_read), await timed(engine_read)
        results["read_decode"].append((n / eng, n / rw))
        eng, rw = await timed(engine_cas), await timed(raw_cas_baseline)
        results["cas"].append((single_n / eng, single_n / rw))

    out: dict[str, object] = {
        "redis": server.kind,
        "reply_parser": "python" if args.python_parser else _parser_name(client),
        "events": n,
        "tokens_per_event": args.tokens,
        "event_bytes": len(blobs[0]),
    }
    for name, pairs in results.items():
        eng_rate = statistics.median(p[0] for p in pairs)
        raw_rate = statistics.median(p[1] for p in pairs)
        ratio = statistics.median(p[0] / p[1] for p in pairs)
        out[f"{name}_per_s"] = round(eng_rate)
        out[f"{name}_raw_per_s"] = round(raw_rate)
        out[f"{name}_ratio"] = round(ratio, 3)
        print(f"{name:16s} engine {eng_rate:10.0f}/s   raw {raw_rate:10.0f}/s   ratio {ratio:.3f}")
    out["redis_benchmark_xadd_per_s"] = redis_benchmark(
        server.port, len(blobs[0]), server.passwords.get("default")
    )
    await client.aclose()
    server.stop()
    return out


def _parser_name(client: object) -> str:
    kwargs = client.connection_pool.connection_kwargs  # type: ignore[attr-defined]
    parser = kwargs.get("parser_class")
    if parser is None:
        from redis.utils import HIREDIS_AVAILABLE

        return "hiredis" if HIREDIS_AVAILABLE else "python"
    return "hiredis" if "Hiredis" in parser.__name__ else "python"


def redis_benchmark(port: int, size: int, password: str | None = None) -> float | None:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    payload = "x" * size
    auth = ["--user", "default", "-a", password] if password else []  # a throwaway server
    proc = subprocess.run(
        [binary, "-p", str(port), *auth, "-n", "20000", "-P", "64", "-q",
         "XADD", "rb:bench", "*", "e", payload],
        capture_output=True, text=True, timeout=120, check=False,
    )
    match = re.search(r"([\d.]+) requests per second", proc.stdout)
    return float(match.group(1)) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python-parser", action="store_true",
                        help="both arms parse replies with redis-py's pure-Python parser")
    out = asyncio.run(run(parser.parse_args()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
