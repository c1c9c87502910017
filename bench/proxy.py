"""The recording proxy's cost: the same multi-turn conversations through the proxy and direct.

Arms, on one tinylm server started by the bench (a subprocess, so the bench's event loop and the
server's scheduler do not share a GIL):

  proxy   a scaffold-like client posts the whole conversation to a ``RecordingProxy``'s
          ``/v1/chat/completions`` each turn (one proxy per conversation, as per task), echoes
          the reply back and appends a user observation; the proxy syncs, tokenizes the
          increment, generates on ``/generate`` and answers a ChatCompletion
  direct  the native agent's way: the same conversations built as a token series in process
          (``ChatTokens``: prompt, then observation increments) and sent to ``/generate``
          through the same pooled backend

Both arms run the same conversations (same messages, seeds and fixed-length outputs via
``ignore_eos``) at the same concurrency; each round runs them one after the other in ABBA order.
``proxy_vs_direct_ratio`` is proxy tokens/s over direct tokens/s (generated tokens over wall
time), median over rounds; target >= 0.9. Only the conversations are timed, in both arms: the
direct arm's pooled client exists before its timer starts, and so do the scaffolds' HTTP clients
(one ``httpx.AsyncClient`` per proxy, made when the scaffold process is handed the proxies'
URLs, as a scaffold makes its OpenAI client at start-up). Building an ``httpx.AsyncClient``
loads the CA bundle into an SSL context (~20 ms, unused on plain http); when the eight were
built inside the timed arm they delayed every conversation's first call by ~150-290 ms of a
~1 s arm, which alone made the proxy arm look 15-25% slower (``scaffold_client_open_ms`` is
that start-up, per client, reported apart like ``proxy_start_stop_ms``).
``proxy_cpu_ms_per_call`` is the bench process's extra CPU per chat call in the proxy arm over
the direct arm (the proxy's HTTP server, request parsing, sync and reply building). The
scaffolds' HTTP clients run in a process of their own, as real scaffolds do, so their CPU is
not in it.
``proxy_extra_ms_per_call`` is the fixed cost of the proxy's path per call: one conversation
at a time (``--latency-turns`` turns, ``--latency-reps`` times), one output token per turn,
median ms per call through the proxy (``proxy_ms_per_call_1tok``) minus direct
(``direct_ms_per_call_1tok``): the second HTTP hop, the scaffold's client, the proxy's
server, guard and reply. Against a turn of T ms it bounds the ratio near T / (T + extra) at
one conversation; with several at once the calls that end together queue on one event loop.
``proxy_start_stop_ms`` is the time to start and tear down one proxy (per task, not per call;
outside the timed arm). ``conversation_capture_valid_share`` is the share of those scripted
proxy conversations whose capture stayed valid.

``capture_valid_share`` is the same share over *real scaffold episodes*: ``--scaffold-episodes``
runs of mini-swe-agent (``InstalledAgent``, the ``swe`` evaluator config) on the bundled
``swe_eval`` tasks, sampled at temperature 1, through the recording proxy, on a tinylm taught
mini-swe-agent's format (``engine.tasks.swe_format``; ``--swe-model DIR`` reuses one, e.g. the
demo's ``runs/demo/tinylm-swe``). Capture goes off when the scaffold drops a malformed reply from
its history, so this is the share of episodes that yield token data. It is over the episodes
that ran to their end; aborts (a timeout, a dead server) are counted apart
(``scaffold_aborted``), with the mean reward and the termination reasons. Needs mini-swe-agent
(``pip install 'rollout-engine[scaffolds]'``); ``--scaffold-episodes 0`` skips it.

    python bench/proxy.py [--rounds 4] [--conversations 8] [--turns 4] [--max-new-tokens 128]
                          [--latency-reps 8] [--latency-turns 16]
                          [--scaffold-episodes 8] [--swe-model DIR] [--swe-train-steps 200]

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
from engine.backends.base import ModelBackend
from engine.backends.pool import BackendPool
from engine.backends.sglang import load_tokenizer
from engine.ops.processes import Processes
from engine.ops.tinylm import init_model
from engine.proxy import RecordingProxy
from workers.cli import ROLLOUT


def opening(i: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": f"Task {i}: explain step {i} of the plan."},
    ]


def observation(i: int, turn: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Observation {turn} for task {i}: exit code 0."}


def params(i: int, turn: int, max_new: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new, "ignore_eos": True, "sampling_seed": 1000 * i + turn}


async def proxy_conversation(client: httpx.AsyncClient, i: int, turns: int, max_new: int) -> int:
    generated = 0
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
    backend: ModelBackend, chat: ChatTokens, i: int, turns: int, max_new: int
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
    opened: list[float] = []
    async with BackendPool(url) as pool:
        backend = pool.get()
        assert backend.capabilities.token_ids

        proxies: list[RecordingProxy] = []
        scaffolds = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client", stdin=PIPE, stdout=PIPE
        )
        to_scaffolds, from_scaffolds = scaffolds.stdin, scaffolds.stdout
        assert to_scaffolds is not None and from_scaffolds is not None

        async def scaffolds_do(op: str, **job: Any) -> dict[str, Any]:
            to_scaffolds.write((json.dumps({"op": op, **job}) + "\n").encode())
            answer: dict[str, Any] = json.loads(await from_scaffolds.readline())
            return answer

        async def via_proxy(_: int) -> int:
            # All conversations at once, in the scaffold process; the reply is the token count.
            answer = await scaffolds_do("run", turns=args.turns, max_new=args.max_new_tokens)
            return int(answer["generated"])

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
                    await scaffolds_do("open", urls=[p.url for p in proxies])
                    opened.append((time.perf_counter() - t1) / len(proxies) * 1000)
                    wall, cpu, res = await arm(which, via_proxy, 1)
                    await scaffolds_do("close")
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
        # The fixed cost per call: one conversation at a time, one output token per turn, so
        # the model's step is negligible and what is left is the path around it.
        fixed_direct: list[float] = []
        fixed_proxy: list[float] = []
        for r in range(args.latency_reps):
            t0 = time.perf_counter()
            await direct_conversation(backend, chat, r, args.latency_turns, 1)
            fixed_direct.append((time.perf_counter() - t0) / args.latency_turns * 1000)
            async with RecordingProxy(backend=backend, tokenizer=tokenizer) as one:
                await scaffolds_do("open", urls=[one.url])
                t0 = time.perf_counter()
                await scaffolds_do("run", turns=args.latency_turns, max_new=1)
                fixed_proxy.append((time.perf_counter() - t0) / args.latency_turns * 1000)
                await scaffolds_do("close")
        to_scaffolds.close()
        await scaffolds.wait()
    fixed: dict[str, Any] = {}
    if fixed_direct:
        d_ms, p_ms = statistics.median(fixed_direct), statistics.median(fixed_proxy)
        fixed = {
            "direct_ms_per_call_1tok": round(d_ms, 2),
            "proxy_ms_per_call_1tok": round(p_ms, 2),
            "proxy_extra_ms_per_call": round(p_ms - d_ms, 2),
        }
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
        "scaffold_client_open_ms": round(statistics.median(opened), 1),
        "conversation_capture_valid_share": sum(valid) / len(valid) if valid else 0.0,
        **fixed,
    }


async def scaffold_episodes(url: str, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``args.scaffold_episodes`` real mini-swe-agent episodes through the proxy."""
    import os
    import shutil
    from collections import Counter

    from engine.agents.base import EpisodeContext
    from engine.agents.installed import InstalledAgent
    from engine.domain import SamplingParams, StoppingCriteria, Task
    from engine.errors import AgentError
    from engine.sandbox import MANAGED_LABEL, LocalSandboxConfig, LocalSandboxProvider
    from engine.tasks.swe import DATA
    from engine.tasks.swe_evaluators import swe_agent_config

    tokenizer = load_tokenizer(model)
    lines = [json.loads(x) for x in (DATA / "swe_eval.jsonl").read_text().splitlines()]
    agent = InstalledAgent(swe_agent_config(tokenizer=tokenizer))
    root = Path(tempfile.mkdtemp(prefix="bench-proxy-sandboxes-"))
    os.chmod(root, 0o711)
    provider = LocalSandboxProvider(LocalSandboxConfig(root=root))
    gate = asyncio.Semaphore(args.scaffold_concurrency)
    outcomes: list[tuple[str, float]] = []  # ("valid" | "invalid" | "aborted:<class>", reward)
    reasons: Counter[str] = Counter()
    invalid: Counter[str] = Counter()
    seconds: list[float] = []

    async def one(i: int, pool: BackendPool, tmp: Path) -> None:
        line = lines[i % len(lines)]
        task = Task(sample_id=f"bench:s{i}", rollout_id="bench", index=i, group_index=i,
                    prompt=line["prompt"], label=line["label"], dataset_name="swe_eval",
                    task_type="swe", source_line=i % len(lines) + 1)  # fmt: skip
        context = EpisodeContext(
            rollout_id="bench", sample_id=task.sample_id, attempt=1,
            stopping=StoppingCriteria(max_turns=6, max_new_tokens=96, timeout_s=240.0),
            sampling_params=SamplingParams(temperature=1.0), tmp_dir=tmp / f"s{i}",
            backends=pool, sandboxes=provider, seed=i,
        )  # fmt: skip
        async with gate:
            episode = agent.episode(task)
            t0 = time.perf_counter()
            try:
                await episode.init(context)
                result = await episode.run(context)
                reward = await episode.eval(context, result)
                score = reward["score"] if isinstance(reward, dict) else reward
                outcomes.append(("valid", float(score)))
                reasons[result.termination_reason.value] += 1
            except AgentError as exc:
                text = str(exc)
                kind = "invalid" if "capture was turned off" in text else "aborted:AgentError"
                if kind == "invalid":
                    # "... turned off (<reason>); ...": the guard's reason, numbers dropped
                    why = text.split("turned off (", 1)[1].rsplit("); ", 1)[0]
                    invalid["".join("N" if c.isdigit() else c for c in why)] += 1
                outcomes.append((kind, 0.0))
            except Exception as exc:
                outcomes.append((f"aborted:{type(exc).__name__}", 0.0))
            finally:
                await episode.cleanup(context)
                seconds.append(time.perf_counter() - t0)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            async with BackendPool(url) as pool:
                await asyncio.gather(
                    *(one(i, pool, Path(tmp)) for i in range(args.scaffold_episodes))
                )
    finally:
        await provider.reap({MANAGED_LABEL: "1"})
        provider.close()
        shutil.rmtree(root, ignore_errors=True)
    ran = [(k, r) for k, r in outcomes if k in ("valid", "invalid")]
    valid = [r for k, r in ran if k == "valid"]
    return {
        "scaffold_episodes": len(outcomes),
        "capture_valid_share": round(len(valid) / len(ran), 3) if ran else 0.0,
        "scaffold_reward_mean": round(sum(valid) / len(valid), 3) if valid else 0.0,
        "scaffold_aborted": dict(Counter(k for k, _ in outcomes if k.startswith("aborted"))),
        "scaffold_terminations": dict(reasons),
        "scaffold_invalid_reasons": dict(invalid),
        "scaffold_seconds_per_episode": round(statistics.median(seconds), 1) if seconds else 0,
    }


async def scaffold_process() -> None:
    """``--client``: the scaffolds' side, in its own process as real scaffolds are. Each stdin
    line is one command, answered by one line: ``open`` makes one HTTP client per proxy URL
    (a scaffold's start-up, as the direct arm's pooled client is made before it is timed),
    ``run`` runs every conversation against its proxy and answers the tokens generated,
    ``close`` closes the clients."""
    loop = asyncio.get_running_loop()
    clients: list[httpx.AsyncClient] = []
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        job = json.loads(line)
        if job["op"] == "open":
            clients = [httpx.AsyncClient(base_url=url, timeout=None) for url in job["urls"]]
            answer: dict[str, Any] = {"clients": len(clients)}
        elif job["op"] == "run":
            counts = await asyncio.gather(
                *(
                    proxy_conversation(client, i, job["turns"], job["max_new"])
                    for i, client in enumerate(clients)
                )
            )
            answer = {"generated": sum(counts)}
        else:
            await asyncio.gather(*(c.aclose() for c in clients))
            clients, answer = [], {"closed": True}
        print(json.dumps(answer), flush=True)


def main() -> None:
    if sys.argv[1:] == ["--client"]:
        asyncio.run(scaffold_process())
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--latency-reps", type=int, default=8)
    parser.add_argument("--latency-turns", type=int, default=16)
    parser.add_argument("--scaffold-episodes", type=int, default=8)
    parser.add_argument("--scaffold-concurrency", type=int, default=2)
    parser.add_argument("--swe-model", type=Path, default=None)
    parser.add_argument("--swe-train-steps", type=int, default=200)
    args = parser.parse_args()
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp), rollout=ROLLOUT) as procs:
        model = Path(tmp) / "model"
        if args.rounds > 0:
            init_model(model, seed=0, train_steps=0)
            server = procs.serve_tinylm("tinylm", model, "--max-running-requests", "16")
            result = asyncio.run(bench(server.url, model, args))
            procs.terminate("tinylm")
        if args.scaffold_episodes > 0:
            import importlib.util

            if importlib.util.find_spec("minisweagent") is None:
                result["capture_valid_share"] = None
                result["scaffold_note"] = "mini-swe-agent is not installed (extra 'scaffolds')"
            else:
                from engine.tasks.swe_format import init_swe_model

                swe_model = args.swe_model
                if swe_model is None:
                    swe_model = Path(tmp) / "swe-model"
                    init_swe_model(swe_model, steps=args.swe_train_steps)
                server = procs.serve_tinylm("tinylm-swe", swe_model)
                result |= asyncio.run(scaffold_episodes(server.url, swe_model, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
