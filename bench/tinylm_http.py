"""tinylm's HTTP front end, A/B: this tree's server against another tree's, side by side.

Both servers serve the same untrained model as subprocesses (one torch thread, 16 slots); the
baseline runs from ``--baseline`` (a checkout of an earlier commit, put first on its
PYTHONPATH), the candidate from this tree. Every round runs each workload on both, in ABBA
order, so whatever else the machine does hits both alike; figures are medians over rounds and
ratios are candidate over baseline (> 1: the candidate is faster).

Workloads (the direct path agents and the recording proxy use):

  decode_c1 / decode_c8   /generate, 64-token prompts, 64 output tokens with logprobs, at
                          concurrency 1 and 8 (tokens/s)
  short_c8                /generate with one output token at concurrency 8 (requests/s):
                          a request's fixed cost, HTTP included
  health_c8               GET /health at concurrency 8 (requests/s): the HTTP stack alone

With ``--proxy N``, ``bench/proxy.py``'s measurement (8 conversations of 4 turns through a
``RecordingProxy`` each vs direct ``/generate``, 2 rounds) also runs N times against each
server, alternating which goes first, and ``proxy_vs_direct_ratio`` is reported per server
(medians): the recording proxy's path with each HTTP stack, in one process.

    python bench/tinylm_http.py --baseline /work/main [--rounds 5] [--proxy 3]

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

from engine.ops.tinylm import init_model
from tinylm.process import spawn_server


def payload(i: int, prompt_len: int, max_new: int) -> dict[str, Any]:
    return {
        "input_ids": [(7 * i + 13 * j) % 600 + 3 for j in range(prompt_len)],
        "sampling_params": {
            "max_new_tokens": max_new,
            "temperature": 1.0,
            "ignore_eos": True,
            "sampling_seed": i,
        },
        "return_logprob": True,
    }


async def gather_limited(n: int, concurrency: int, one: Callable[[int], Awaitable[int]]) -> int:
    gate = asyncio.Semaphore(concurrency)

    async def run(i: int) -> int:
        async with gate:
            return await one(i)

    return sum(await asyncio.gather(*(run(i) for i in range(n))))


Workload = Callable[[httpx.AsyncClient], Awaitable[float]]


def generate(n: int, concurrency: int, max_new: int) -> Workload:
    async def work(client: httpx.AsyncClient) -> float:
        async def one(i: int) -> int:
            reply = await client.post("/generate", json=payload(i, 64, max_new))
            reply.raise_for_status()
            return len(reply.json()["output_ids"]) if max_new > 1 else 1

        t0 = time.perf_counter()
        units = await gather_limited(n, concurrency, one)
        return units / (time.perf_counter() - t0)

    return work


def health(n: int, concurrency: int) -> Workload:
    async def work(client: httpx.AsyncClient) -> float:
        async def one(i: int) -> int:
            (await client.get("/health")).raise_for_status()
            return 1

        t0 = time.perf_counter()
        units = await gather_limited(n, concurrency, one)
        return units / (time.perf_counter() - t0)

    return work


async def measure(urls: dict[str, str], rounds: int, scale: int) -> dict[str, Any]:
    workloads: dict[str, Workload] = {
        "decode_c1": generate(4 * scale, 1, 64),
        "decode_c8": generate(16 * scale, 8, 64),
        "short_c8": generate(64 * scale, 8, 1),
        "health_c8": health(400 * scale, 8),
    }
    clients = {
        arm: httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=16))
        for arm, url in urls.items()
    }
    results: dict[str, dict[str, list[float]]] = {
        name: {arm: [] for arm in urls} for name in workloads
    }
    try:
        for arm in urls:  # warm both: connections, first forwards
            await workloads["short_c8"](clients[arm])
        for r in range(rounds):
            order = ["baseline", "candidate"] if r % 2 == 0 else ["candidate", "baseline"]
            for name, work in workloads.items():
                for arm in (*order, *reversed(order)):  # ABBA
                    results[name][arm].append(await work(clients[arm]))
    finally:
        for client in clients.values():
            await client.aclose()
    out: dict[str, Any] = {}
    for name, arms in results.items():
        base = statistics.median(arms["baseline"])
        cand = statistics.median(arms["candidate"])
        ratios = [c / b for c, b in zip(arms["candidate"], arms["baseline"], strict=True)]
        out[f"{name}_baseline"] = round(base, 1)
        out[f"{name}_candidate"] = round(cand, 1)
        out[f"{name}_ratio"] = round(statistics.median(ratios), 3)
    return out


def proxy_ab(urls: dict[str, str], model: Path, repeats: int) -> dict[str, Any]:
    """``bench/proxy.py``'s ``bench`` against each server in turn (see the module docstring)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_proxy", Path(__file__).with_name("proxy.py")
    )
    assert spec is not None and spec.loader is not None
    proxy_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proxy_bench)
    options = argparse.Namespace(rounds=2, conversations=8, turns=4, max_new_tokens=128)
    ratios: dict[str, list[float]] = {arm: [] for arm in urls}
    for k in range(repeats):
        order = ["baseline", "candidate"] if k % 2 == 0 else ["candidate", "baseline"]
        for arm in order:
            figures = asyncio.run(proxy_bench.bench(urls[arm], model, options))
            ratios[arm].append(figures["proxy_vs_direct_ratio"])
    return {
        f"proxy_vs_direct_ratio_{arm}": round(statistics.median(values), 3)
        for arm, values in ratios.items()
    } | {f"proxy_vs_direct_ratios_{arm}": values for arm, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="tree of the baseline")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--scale", type=int, default=1, help="multiplies every request count")
    parser.add_argument("--proxy", type=int, default=0, help="runs of bench/proxy.py per server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tinylm-http-") as tmp:
        model = Path(tmp) / "tinylm"
        init_model(model, train_steps=0)
        flags = ["--max-running-requests", "16"]
        # /health without the one-token generation SGLang runs for it by default: the plain
        # route, so that health_c8 measures the HTTP stack
        plain = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
        env = {"PYTHONPATH": str(args.baseline.resolve()), **plain}
        with spawn_server(model, extra_args=flags, env=env) as base:
            with spawn_server(model, extra_args=flags, env=plain) as cand:
                urls = {"baseline": base.url, "candidate": cand.url}
                figures = asyncio.run(measure(urls, args.rounds, args.scale))
                if args.proxy:
                    figures.update(proxy_ab(urls, model, args.proxy))
    print(json.dumps({"bench": "tinylm_http", "rounds": args.rounds, **figures}))


if __name__ == "__main__":
    main()
