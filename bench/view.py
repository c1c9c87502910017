"""``rollout view`` on a large rollout: the rollout page and a long sample page, timed.

A rollout of ``--samples`` samples (default 20,000; one turn each, every 10th retried once,
every 25th aborted, a few pool and weight-sync events) is written straight to a real
redis-server through the engine's append path (no agent runs), with one sample of
``--tokens`` response tokens (default 10,000). Then the viewer's app, on that log, serves:

* ``rollout_page_s``: ``GET /r/<rollout>`` the first time (the whole stream read and folded,
  the timeline of every sample drawn), the best of ``--rounds`` fresh viewers;
* ``sample_page_s``: ``GET /r/<rollout>/s/<long sample>`` on a viewer that has the rollout
  folded (its entries read back, every token drawn), the best of ``--rounds``.

Times are wall seconds in this process, through httpx's ASGI transport (no socket), and
``rollout_page_cpu_s`` this process's CPU seconds for the rollout page (the figure a loaded
machine blurs least; redis-server's share is not in it). The targets: the rollout page under
2 s, the sample page under 1 s.

    python bench/view.py [--samples 20000] [--tokens 10000] [--rounds 3]

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.events import (  # noqa: E402
    AbortClass,
    BatchSealed,
    Event,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TurnCompleted,
)
from engine.events.catalog import (  # noqa: E402
    PolicyVersionActivated,
    QuiesceCompleted,
    QuiesceRequested,
    TokenAcquired,
    TokenReleased,
)
from engine.events.catalog.pool import NodeDecl, PoolDeclared, TokenGrant  # noqa: E402
from engine.events.catalog.servers import ServerDown, ServerUp  # noqa: E402
from engine.events.names import StreamNames  # noqa: E402
from engine.outcomes import TerminationReason  # noqa: E402

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
"""What an agent's output may hold: the viewer must show it as text."""

Timed = tuple[str, Event, int]
"""An event, the stream it goes to and its time (ms) in the made-up rollout."""


def synthetic_rollout(
    rollout_id: str,
    n_samples: int,
    *,
    long_tokens: int = 0,
    tokens: int = 24,
    t0_ms: int = 1_700_000_000_000,
    names: StreamNames | None = None,
    hostile: bool = False,
    ready: bool = True,
    seed: int = 0,
) -> list[Timed]:
    """Every event of one rollout, in time order: ``rl:control`` (the request, a quiesce and
    an activation mid-way, a model server that goes down and comes back), the rollout
    stream (tasks, batches of 8, the plan, starts, one turn and a terminal per sample; every
    10th sample retried once and every 25th aborted), ``rl:pool`` (the layout, a grant and a
    release per batch) and, with ``ready``, ``RolloutReady``. Sample 0 has ``long_tokens``
    response tokens when given; ``hostile`` puts markup in a response, a tool call, an error
    and a prompt."""
    names = names or StreamNames()
    stream, rng = names.rollout(rollout_id), random.Random(seed)
    n_groups = max(1, n_samples // 4)
    request = RolloutRequested(rollout_id=rollout_id, n_prompts=n_groups,
                               n_samples_per_prompt=4, iteration=3, policy_version=2)
    layout = PoolDeclared(nodes=[NodeDecl(node=f"node-{n}", gpus=[0], cpu=8.0, memory_gb=32.0)
                                 for n in range(3)])
    out: list[Timed] = [(names.control, request, t0_ms), (stream, request, t0_ms),
                        (names.pool, layout, t0_ms)]
    sids = [f"{rollout_id}:s{i}" for i in range(n_samples)]
    datasets = ("math_train", "shell_train")
    for i, sid in enumerate(sids):
        prompt = [{"role": "user", "content": (HOSTILE if hostile and i == 1 else
                                               f"what is {i // 4} * 7?")}]
        out.append((stream, TaskFetched(
            rollout_id=rollout_id, sample_id=sid, index=i, group_index=i // 4, prompt=prompt,
            dataset=datasets[(i // 4) % 2], task_type="math", source_line=i // 4 + 1,
        ), t0_ms + 1))
    batches = [sids[b:b + 8] for b in range(0, n_samples, 8)]
    for seq, ids in enumerate(batches):
        out.append((stream, BatchSealed(rollout_id=rollout_id, batch_id=f"{rollout_id}:b{seq}",
                                        seq=seq, evaluator_id="math", sample_ids=ids), t0_ms + 2))
    out.append((stream, RolloutPlanned(rollout_id=rollout_id, n_samples=n_samples,
                                       n_batches=len(batches)), t0_ms + 3))
    span_ms = 60_000
    kept: list[str] = []
    n_aborted = 0
    for seq, ids in enumerate(batches):
        at = t0_ms + 10 + seq * span_ms // max(1, len(batches))
        bid = f"{rollout_id}:b{seq}"
        node = f"node-{seq % 3}"
        grant = TokenGrant(token_id=f"{bid}:t0", node=node, cpu=1.0)
        out.append((names.pool, TokenAcquired(rollout_id=rollout_id, batch_id=bid,
                                              evaluator_id="math", tokens=[grant]), at))
        end = at
        for sid in ids:
            i = int(sid.rsplit(":s", 1)[1])
            start = at + rng.randint(0, 400)
            worker = f"worker-{i % 4}"
            attempt = 0
            if i % 10 == 3:  # a first attempt that a redelivery replaced
                out.append((stream, SampleStarted(rollout_id=rollout_id, sample_id=sid,
                                                  batch_id=bid, worker=worker, node=node), start))
                start, attempt = start + rng.randint(200, 900), 1
            out.append((stream, SampleStarted(rollout_id=rollout_id, sample_id=sid,
                                              attempt=attempt, batch_id=bid, worker=worker,
                                              node=node), start))
            stop = start + rng.randint(300, 3000)
            end = max(end, stop)
            calls = [HOSTILE] if hostile and i == 2 else ["python"]
            n = long_tokens if i == 0 and long_tokens else tokens
            out.append((stream, TurnCompleted(
                rollout_id=rollout_id, sample_id=sid, attempt=attempt, turn=0, node=node,
                prompt_tokens=16, response_tokens=n, tool_calls=calls,
                elapsed_s=(stop - start) / 1000, weight_version=2,
            ), stop - 1))
            if i % 25 == 7:
                n_aborted += 1
                out.append((stream, SampleAborted(
                    rollout_id=rollout_id, sample_id=sid, attempt=attempt,
                    abort_class=AbortClass.INFRA_SANDBOX, phase="tool",
                    error=HOSTILE if hostile else "sandbox exited 137", node=node, turns=1,
                ), stop))
                continue
            reward = float(rng.random() < 0.4)
            out.append((stream, SampleCompleted(
                rollout_id=rollout_id, sample_id=sid, attempt=attempt,
                prompt_ids=[rng.randint(0, 150_000) for _ in range(16)],
                response_ids=[rng.randint(0, 150_000) for _ in range(n)],
                logprobs=[-rng.random() * 3 for _ in range(n)],
                loss_mask=[int(j % 9 != 8) for j in range(n)],
                token_versions=[2 if j % 9 != 8 else -1 for j in range(n)],
                reward=reward, termination_reason=TerminationReason.FINISH,
                response_text=(HOSTILE if hostile and i == 0 else f"the answer is {i}"),
                n_turns=1, elapsed_s=(stop - start) / 1000, policy_version=2,
            ), stop))
            kept.append(sid)
        out.append((names.pool, TokenReleased(rollout_id=rollout_id, batch_id=bid,
                                              reason="done"), end + 1))
    mid = t0_ms + span_ms // 2
    server = "http://10.0.0.1:30000"
    out += [(names.control, ServerUp(endpoint=server, worker="worker-0", weight_version=2),
             t0_ms + 5),
            (names.control, ServerDown(endpoint=server, worker="worker-1",
                                       reason="connection refused"), mid - 8000),
            (names.control, ServerUp(endpoint=server, worker="worker-1", weight_version=3),
             mid + 950),
            (names.control, QuiesceRequested(reason="weight sync", version=3), mid),
            (names.control, QuiesceCompleted(reason="weight sync", version=3), mid + 800),
            (names.control, PolicyVersionActivated(version=3, servers=["http://s0"]), mid + 900)]
    if ready:
        last = max(t for _, _, t in out)
        out.append((stream, RolloutReady(
            rollout_id=rollout_id, iteration=3, policy_version=2, sample_ids=kept,
            n_completed=len(kept), n_aborted=n_aborted,
        ), last + 5))
    return sorted(out, key=lambda item: item[2])


async def write(log: object, events: list[Timed], *, chunk: int = 2000) -> None:
    """Append the events in order through the log's ``append_many``."""
    items = [(stream, ev) for stream, ev, _ in events]
    for at in range(0, len(items), chunk):
        await log.append_many(items[at:at + chunk])  # type: ignore[attr-defined]


def _best(times: list[float]) -> float:
    return round(min(times), 4)


async def _measure(args: argparse.Namespace) -> dict[str, object]:
    import httpx

    from engine.events.redis_log import RedisSettings, open_log
    from engine.ops.embedded import start_redis
    from engine.ops.view import ViewData, create_app

    redis = start_redis()
    try:
        names = StreamNames()
        log = open_log(RedisSettings(url=redis.url), names=names, producer="bench")
        rid = "bench-view"
        events = synthetic_rollout(rid, args.samples, long_tokens=args.tokens, names=names)
        t = time.perf_counter()
        await write(log, events)
        write_s = time.perf_counter() - t
        rollout_s, rollout_cpu, sample_s, sizes = [], [], [], {}
        for _ in range(args.rounds):
            app = create_app(ViewData(log))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://view") as client:
                t, cpu = time.perf_counter(), time.process_time()
                page = await client.get(f"/r/{rid}")
                rollout_s.append(time.perf_counter() - t)
                rollout_cpu.append(time.process_time() - cpu)
                assert page.status_code == 200, page.text[:500]
                t = time.perf_counter()
                sample = await client.get(f"/r/{rid}/s/{rid}:s0")
                sample_s.append(time.perf_counter() - t)
                assert sample.status_code == 200, sample.text[:500]
            sizes = {"rollout_page_bytes": len(page.content),
                     "sample_page_bytes": len(sample.content)}
        await log.aclose()
    finally:
        redis.stop()
    return {
        "samples": args.samples, "tokens": args.tokens, "entries": len(events),
        "write_s": round(write_s, 3), **sizes,
        "rollout_page_cpu_s": _best(rollout_cpu),
        "rollout_page_s": _best(rollout_s), "sample_page_s": _best(sample_s),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    result = asyncio.run(_measure(parser.parse_args()))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
