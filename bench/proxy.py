"""The recording proxy's cost: the same multi-turn conversations through the proxy and direct.

Arms, on one tinylm server started by the bench (a subprocess, so the bench's event loop and the
server's scheduler do not share a GIL):

  proxy   a scaffold-like client posts the whole conversation to a ``RecordingProxy``'s
          ``/v1/chat/completions`` each turn (one proxy per conversation, as per task), echoes
          the reply back and appends a user observation; the proxy syncs, tokenizes the
          increment, generates on ``/generate`` and answers a ChatCompletion
  direct  the native agent's way: the same conversations built as a token series in process
          (``ChatTokens``: prompt, then observation increments) and sent to ``/generate``
          through the same pooled ``SGLangBackend``

Both arms run the same conversations (same messages, seeds and fixed-length outputs via
``ignore_eos``) at the same concurrency; each round runs them one after the other in ABBA order.
``proxy_vs_direct_ratio`` is proxy tokens/s over direct tokens/s (generated tokens over wall
time), median over rounds; target >= 0.9. ``proxy_cpu_ms_per_call`` is the bench process's
extra CPU per chat call in the proxy arm over the direct arm (the proxy's HTTP server, request
parsing, sync and reply building). The scaffolds' HTTP clients run in a process of their own,
as real scaffolds do, so their CPU is not in it.
``proxy_start_stop_ms`` is the time to start and tear down one proxy (per task, not per call;
outside the timed arm). ``capture_valid_share`` is the share of proxy conversations whose
capture stayed valid.

    python bench/proxy.py [--rounds 4] [--conversations 8] [--turns 4] [--max-new-tokens 128]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

import httpx

from engine.agents.chat_tokens import ChatTokens
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, load_tokenizer
from engine.ops.tinylm import init_model, spawn_server
from engine.proxy import RecordingProxy


def opening(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": f"Task {i}: explain step {i} of the plan."},
    ]


def observation(i: int, turn: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Observation {turn} for task {i}: exit code 0."}


def params(i: int, turn: int, max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 1000 * i + turn}


async def proxy_conversation(url: str, i: int, turns: int, max_new: int) -> int:
    generated = 0
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        messages = opening(i)
        for turn in range(turns):
            p = params(i, turn, max_new)
            reply = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tinylm",
                    "messages": messages,
                    "max_tokens": p["max_new_tokens"],
                    "ignore_eos": True,
                    "seed": p["sampling_seed"],
                },
            )
            reply.raise_for_status()
            body = reply.json()
            generated += int(body["usage"]["completion_tokens"])
            message = {k: v for k, v in body["choices"][0]["message"].items() if v is not None}
            messages = [*messages, message, observation(i, turn)]
    return generated


async def direct_conversation(
    backend: SGLangBackend, chat: ChatTokens, i: int, turns: int, max_new: int
) -> int:
    generated = 0
    special = set(chat.tokenizer.all_special_ids)
    history = opening(i)
    series = chat.prompt_ids(history)
    for turn in range(turns):
        gen = await backend.generate(input_ids=series, sampling_params=params(i, turn, max_new))
        assert gen.token_ids is not None
        ids = list(gen.token_ids)
        generated += len(ids)
        obs = chat.observation(history, ids, [observation(i, turn)])
        end = len(ids)
        while end and ids[end - 1] in special:
            end -= 1
        raw = chat.decode(ids[:end], skip_special_tokens=False)
        history = [*history, {"role": "assistant", "content": raw}, observation(i, turn)]
        series = [*series, *ids, *obs.token_ids]
    return generated


async def arm(name: str, run: Any, conversations: int) -> tuple[float, float, list[Any]]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(run(i) for i in range(conversations)))
    return time.perf_counter() - t0, time.process_time() - cpu0, list(results)


async def bench(url: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(model)
    chat = ChatTokens(tokenizer, None)
    calls = args.conversations * args.turns
    ratios: list[float] = []
    proxy_tps: list[float] = []
    direct_tps: list[float] = []
    extra_cpu: list[float] = []
    valid: list[bool] = []
    lifecycle: list[float] = []
    async with BackendPool(url) as pool:
        backend = pool.get()
        assert isinstance(backend, SGLangBackend)

        proxies: list[RecordingProxy] = []
        scaffolds = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", stdin=PIPE, stdout=PIPE
        )
        to_scaffolds, from_scaffolds = scaffolds.stdin, scaffolds.stdout
        assert to_scaffolds is not None and from_scaffolds is not None

        async def via_proxy(_: int) -> int:
            # All conversations at once, in the scaffold process; the reply is the token count.
            job = {"urls": [p.url for p in proxies], "turns": args.turns,
                   "max_new": args.max_new_tokens}  # fmt: skip
            to_scaffolds.write((json.dumps(job) + "\n").encode())
            return int(json.loads(await from_scaffolds.readline())["generated"])

        async def direct(i: int) -> int:
            return await direct_conversation(backend, chat, i, args.turns, args.max_new_tokens)

        await arm("warmup", direct, 2)
        for r in range(args.rounds):
            order = ["proxy", "direct"] if r % 2 == 0 else ["direct", "proxy"]
            got: dict[str, tuple[float, float, int]] = {}
            for which in order:
                if which == "proxy":
                    # One proxy per task, started before its scaffold runs and stopped after:
                    # timed apart, since a task lives for many calls.
                    t0 = time.perf_counter()
                    proxies = [
                        await RecordingProxy(backend=backend, tokenizer=tokenizer).__aenter__()
                        for _ in range(args.conversations)
                    ]
                    t1 = time.perf_counter()
                    wall, cpu, res = await arm(which, via_proxy, 1)
                    t2 = time.perf_counter()
                    await asyncio.gather(*(p.aclose() for p in proxies))
                    lifecycle.append((t1 - t0 + time.perf_counter() - t2) / len(proxies) * 1000)
                    valid.extend(p.trajectory() is not None for p in proxies)
                    got[which] = (wall, cpu, sum(res))
                else:
                    wall, cpu, res = await arm(which, direct, args.conversations)
                    got[which] = (wall, cpu, sum(res))
            p_tps = got["proxy"][2] / got["proxy"][0]
            d_tps = got["direct"][2] / got["direct"][0]
            proxy_tps.append(p_tps)
            direct_tps.append(d_tps)
            ratios.append(p_tps / d_tps)
            extra_cpu.append((got["proxy"][1] - got["direct"][1]) / calls * 1000.0)
        to_scaffolds.close()
        await scaffolds.wait()
    return {
        "bench": "proxy",
        "rounds": args.rounds,
        "conversations": args.conversations,
        "turns": args.turns,
        "max_new_tokens": args.max_new_tokens,
        "proxy_tokens_per_s": round(statistics.median(proxy_tps), 1),
        "direct_tokens_per_s": round(statistics.median(direct_tps), 1),
        "proxy_vs_direct_ratio": round(statistics.median(ratios), 3),
        "proxy_vs_direct_ratio_min": round(min(ratios), 3),
        "proxy_cpu_ms_per_call": round(statistics.median(extra_cpu), 2),
        "proxy_start_stop_ms": round(statistics.median(lifecycle), 1),
        "capture_valid_share": sum(valid) / len(valid) if valid else 0.0,
    }


async def scaffold_process() -> None:
    """``--client``: the scaffolds' side, in its own process as real scaffolds are. Each stdin
    line is a round: run every conversation against its proxy, answer the tokens generated."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = json.loads(line)
        counts = await asyncio.gather(
            *(
                proxy_conversation(url, i, job["turns"], job["max_new"])
                for i, url in enumerate(job["urls"])
            )
        )
        print(json.dumps({"generated": sum(counts)}), flush=True)


def main() -> None:
    if sys.argv[1:] == ["--client"]:
        asyncio.run(scaffold_process())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        init_model(model, seed=0, train_steps=0)
        with spawn_server(model, extra_args=["--max-running-requests", "16"]) as server:
            result = asyncio.run(bench(server.url, model, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
