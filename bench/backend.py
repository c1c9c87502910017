"""Backend overhead and tinylm throughput, measured against a baseline in the same run.

Arms, on one tinylm server started by the bench (a subprocess, so the client's event loop and
the server's scheduler do not share a GIL):

  backend  SGLangBackend.generate (payload build, pooled client, strict reply parsing)
  raw      the same /generate payloads through a bare pooled httpx.AsyncClient + .json()

Both arms send identical requests (fixed-length outputs: ``ignore_eos``) at the same
concurrency. Each round runs them twice: side by side (both at once, so whatever else the
machine does hits both equally; ``backend_vs_raw_ratio``, target >= 0.95) and one after the other
in ABBA order (``backend_vs_raw_ratio_alone``). Ratios are backend tokens/s over raw tokens/s,
medians over rounds. ``client_cost_us_per_reply_*`` is the noise-free part: client CPU per reply.
The raw arm is then run alone at concurrency 1 and 8 for tinylm's throughput and batching gain.

    python bench/backend.py [--rounds 8] [--requests 32] [--max-new-tokens 64]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from engine.backends import GenerationResult, SGLangBackend, SGLangConfig
from engine.backends.sglang_protocol import parse_generate_reply
from engine.ops.processes import Processes
from engine.ops.tinylm import init_model
from workers.cli import ROLLOUT

Arm = Callable[[list[dict[str, Any]], int], Awaitable[int]]


def payloads(n: int, prompt_len: int, max_new: int, offset: int) -> list[dict[str, Any]]:
    return [
        {
            "input_ids": [(7 * i + 13 * j + offset) % 600 + 3 for j in range(prompt_len)],
            "sampling_params": {
                "max_new_tokens": max_new,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": offset + i,
            },
        }
        for i in range(n)
    ]


async def run_concurrently(
    items: list[dict[str, Any]], concurrency: int, one: Callable[[dict[str, Any]], Awaitable[int]]
) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def guarded(item: dict[str, Any]) -> int:
        async with gate:
            return await one(item)

    return sum(await asyncio.gather(*(guarded(i) for i in items)))


def backend_arm(backend: SGLangBackend) -> Arm:
    async def one(item: dict[str, Any]) -> int:
        result = await backend.generate(
            input_ids=item["input_ids"], sampling_params=item["sampling_params"]
        )
        assert result.token_ids is not None
        return len(result.token_ids)

    return lambda items, c: run_concurrently(items, c, one)


def raw_arm(client: httpx.AsyncClient, url: str) -> Arm:
    async def one(item: dict[str, Any]) -> int:
        response = await client.post(url, json={**item, "return_logprob": True})
        response.raise_for_status()
        return len(response.json()["meta_info"]["output_token_logprobs"])

    return lambda items, c: run_concurrently(items, c, one)


async def timed(arm: Arm, items: list[dict[str, Any]], concurrency: int) -> float:
    began = time.perf_counter()
    tokens = await arm(items, concurrency)
    return tokens / (time.perf_counter() - began)


def client_overhead_us(reply: httpx.Response, repeat: int = 2000) -> dict[str, float]:
    """CPU per reply on the client: JSON decode (raw) vs decode + strict parse + result (backend).

    A noise-free complement to the end-to-end ratio: what the backend adds, in microseconds.
    """
    body = reply.content
    raw_start = time.perf_counter()
    for _ in range(repeat):
        json.loads(body)["meta_info"]["output_token_logprobs"]
    raw = (time.perf_counter() - raw_start) / repeat
    backend_start = time.perf_counter()
    for _ in range(repeat):
        parsed = parse_generate_reply(json.loads(body), url="bench", logprobs=True)
        assert parsed.output_logprobs is not None
        GenerationResult(
            text=parsed.text,
            token_ids=parsed.output_ids,
            logprobs=parsed.output_logprobs,
            finish_reason="length",
        )
    backend = (time.perf_counter() - backend_start) / repeat
    return {"raw": raw * 1e6, "backend": backend * 1e6}


async def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    backend = SGLangBackend(config=SGLangConfig(url=url))
    client = httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)
    )
    arms = {"backend": backend_arm(backend), "raw": raw_arm(client, url + "/generate")}
    try:
        warm = payloads(args.concurrency, args.prompt_len, 4, offset=10_000)
        for arm in arms.values():
            await arm(warm, args.concurrency)
        side: dict[str, list[float]] = {"backend": [], "raw": []}
        seq: dict[str, list[float]] = {"backend": [], "raw": []}
        side_ratios: list[float] = []
        seq_ratios: list[float] = []
        for r in range(args.rounds):
            items = payloads(args.requests, args.prompt_len, args.max_new_tokens, offset=r * 97)
            # Side by side: both arms at once on the same server, so whatever the machine does
            # hits both; they alternate which one's requests are queued first.
            names = ["backend", "raw"] if r % 2 == 0 else ["raw", "backend"]
            rates = await asyncio.gather(*(timed(arms[n], items, args.concurrency) for n in names))
            got = dict(zip(names, rates, strict=True))
            side_ratios.append(got["backend"] / got["raw"])
            # One after the other, ABBA order so a linear drift cancels over two rounds.
            order = ["backend", "raw"] if r % 4 in (0, 3) else ["raw", "backend"]
            alone = {n: await timed(arms[n], items, args.concurrency) for n in order}
            seq_ratios.append(alone["backend"] / alone["raw"])
            for n in names:
                side[n].append(got[n])
                seq[n].append(alone[n])
            print(
                f"round {r + 1}/{args.rounds}: side by side backend {got['backend']:.0f} / raw "
                f"{got['raw']:.0f} tok/s (ratio {side_ratios[-1]:.3f}); alone backend "
                f"{alone['backend']:.0f} / raw {alone['raw']:.0f} tok/s "
                f"(ratio {seq_ratios[-1]:.3f})",
                flush=True,
            )
        overhead_us = client_overhead_us(
            await client.post(
                url + "/generate",
                json={
                    **payloads(1, args.prompt_len, args.max_new_tokens, 0)[0],
                    "return_logprob": True,
                },
            )
        )
        print(
            f"client-side cost per reply: backend {overhead_us['backend']:.1f} us, "
            f"raw {overhead_us['raw']:.1f} us",
            flush=True,
        )
        scaling: dict[int, float] = {}
        for concurrency in (1, 8):
            items = payloads(
                max(concurrency, args.requests // 2), args.prompt_len, args.max_new_tokens, 5_000
            )
            scaling[concurrency] = statistics.median(
                [await timed(arms["raw"], items, concurrency) for _ in range(2)]
            )
            print(
                f"tinylm at concurrency {concurrency}: {scaling[concurrency]:.0f} tok/s", flush=True
            )
    finally:
        await backend.aclose()
        await client.aclose()
    return {
        "bench": "backend",
        "backend_vs_raw_ratio": round(statistics.median(side_ratios), 4),
        "backend_vs_raw_ratio_per_round": [round(x, 4) for x in side_ratios],
        "backend_vs_raw_ratio_alone": round(statistics.median(seq_ratios), 4),
        "backend_vs_raw_ratio_alone_per_round": [round(x, 4) for x in seq_ratios],
        "backend_tokens_per_s_side_by_side": round(statistics.median(side["backend"]), 1),
        "raw_tokens_per_s_side_by_side": round(statistics.median(side["raw"]), 1),
        "backend_tokens_per_s_alone": round(statistics.median(seq["backend"]), 1),
        "raw_tokens_per_s_alone": round(statistics.median(seq["raw"]), 1),
        "client_cost_us_per_reply_backend": round(overhead_us["backend"], 1),
        "client_cost_us_per_reply_raw": round(overhead_us["raw"], 1),
        "tinylm_tokens_per_s_c1": round(scaling[1], 1),
        "tinylm_tokens_per_s_c8": round(scaling[8], 1),
        "tinylm_batching_speedup_c8_vs_c1": round(scaling[8] / scaling[1], 2),
        "concurrency": args.concurrency,
        "requests_per_round": args.requests,
        "rounds": args.rounds,
        "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests per arm per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a tinylm folder (default: a fresh untrained one in a temp dir)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-backend-") as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "tinylm"
            init_model(model, seed=0, train_steps=0)
        with Processes(Path(tmp), rollout=ROLLOUT) as procs:
            server = procs.serve_tinylm("tinylm", model, "--max-running-requests", "16")
            result = asyncio.run(bench(server.url, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
