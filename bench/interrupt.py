"""The pause of a weight sync with long turns in flight: waiting for them vs interrupting them.

One tinylm server (in this process, CPU) serves ``--trajectories`` long turns at once
(``--tokens`` tokens each, ``ignore_eos``) through a worker's ``BackendPool``. Once the turns
are about a third done (``--cut``), the trainer publishes a version and the real saga runs
on an in-memory log: the ``WeightSyncer`` requests the quiesce, the worker's
``WorkerQuiesce`` closes its ``TurnGate`` and parks, the syncer loads the new weights with
``/update_weights_from_disk``, checks the version and activates it, and the gate opens.

* ``wait``: ``SyncConfig(interrupt=False)``: the turns in flight finish on the old weights
  before the worker parks (and the server's update waits for them as well);
* ``interrupt``: the worker aborts them, the weights are swapped, and each turn continues
  from its partial tokens on the new weights.

The pause is the time the worker's gate stays closed (its ``close`` to its ``open``). The arms
alternate for ``--rounds`` rounds; ``interrupt_vs_wait_pause_ratio`` = median interrupting
pause / median waiting pause (target <= 0.2). Every turn is checked to come back whole
(``--tokens`` tokens) and, when interrupted, split between the two versions. The last line
printed is one JSON object.

    python bench/interrupt.py [--trajectories 4] [--tokens 1500] [--cut 0.33] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from engine.actors.weight_sync import SyncConfig, WeightSyncer, WorkerQuiesce  # noqa: E402
from engine.backends.base import GenerationResult  # noqa: E402
from engine.backends.pool import BackendPool  # noqa: E402
from engine.backends.sglang import SGLangBackend, SGLangConfig  # noqa: E402
from engine.client import RolloutClient  # noqa: E402
from engine.events.memory_log import MemoryEventLog, MemoryStore  # noqa: E402
from engine.ops.tinylm import init_model  # noqa: E402
from engine.projections.control import ControlProjection  # noqa: E402
from engine.runtime.consumer import Backoff  # noqa: E402
from engine.runtime.follower import Follower, following  # noqa: E402
from tinylm.server import TinyLMServer, start_server  # noqa: E402

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]
BLOCK_MS = 20


def perturbed(src: Path, dst: Path, seed: int) -> Path:
    """A copy of ``src`` whose weights moved by seeded noise (a trainer step)."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
              str(dst / "model.safetensors"))
    return dst


async def keep_listed(log: MemoryEventLog, stop: asyncio.Event) -> None:
    """Keep the worker listed as a live consumer of its work stream, as its reads do."""
    stream = log.names.work("bench")
    await log.ensure_group(stream, "evaluators")
    while not stop.is_set():
        await log.read_group("evaluators", "w1", [stream], block_ms=0)
        await asyncio.sleep(0.1)


def time_the_gate(pool: BackendPool) -> list[float]:
    """Each stretch of time the worker's gate will be closed, in seconds: its ``close`` and
    ``open`` are timed as the worker's quiesce calls them."""
    gate, spans = pool.gate, []
    close, open_ = gate.close, gate.open
    closed_at: list[float] = []

    def closing(reason: str = "") -> None:
        if gate.is_open:
            closed_at.append(time.perf_counter())
        close(reason)

    def opening() -> None:
        if not gate.is_open and closed_at:
            spans.append(time.perf_counter() - closed_at.pop())
        open_()

    setattr(gate, "close", closing)  # noqa: B010 (an instance's methods, timed)
    setattr(gate, "open", opening)  # noqa: B010
    return spans


async def one_sync(
    server: TinyLMServer, weights: Path, version: int, *, interrupt: bool, tokens: int,
    trajectories: int, cut: float,
) -> dict[str, Any]:
    """Long turns in flight, one sync to ``version`` a ``cut`` of the way in: the pause."""
    store = MemoryStore()
    logs = [MemoryEventLog(store, producer=p, block_ms=BLOCK_MS) for p in ("w", "s", "t")]
    worker_log, sync_log, trainer_log = logs
    stop = asyncio.Event()
    control = Follower(worker_log, worker_log.names.control, ControlProjection(),
                       block_ms=BLOCK_MS)
    pool = BackendPool(server.url, build=lambda url: SGLangBackend(
        config=SGLangConfig(url=url, stall_s=30.0)))
    pool.health.expected = lambda: control.state.active_version
    pauses = time_the_gate(pool)
    quiesce = WorkerQuiesce(worker_log, pool.gate, worker_id="w1", control=control)
    syncer = WeightSyncer(sync_log, SyncConfig(
        syncer_id="s1", servers=(server.url,), live_window_ms=5_000, heartbeat_ms=100,
        claim_idle_ms=2_000, block_ms=BLOCK_MS, interrupt=interrupt,
    ))  # fmt: skip
    client = RolloutClient(trainer_log)
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    async with following(stop, control):
        await quiesce.start(Backoff())
        tasks = [
            asyncio.create_task(quiesce.run()),
            asyncio.create_task(syncer.run(stop)),
            asyncio.create_task(keep_listed(worker_log, stop)),
        ]
        turns = [
            asyncio.create_task(pool.bind(f"s{i}/a1").get().generate(
                input_ids=PROMPT, sampling_params=params))
            for i in range(trajectories)
        ]  # fmt: skip
        start = server.scheduler.steps
        while server.scheduler.steps < start + cut * tokens:
            await asyncio.sleep(0.005)
        await client.publish_version(version, str(weights))
        await client.wait_version_active(version, timeout=600)
        results: list[GenerationResult] = await asyncio.gather(*turns)
        stop.set()
        control.close()  # the worker's quiesce ends with its follower
        await asyncio.gather(*tasks, return_exceptions=True)
    await pool.aclose()
    for log in logs:
        await log.aclose()
    split = 0
    for result in results:
        assert len(result.token_ids or ()) == tokens, "a turn came back short or long"
        versions = set(result.versions())
        assert versions <= {version - 1, version}, versions
        split += len(versions) == 2
    assert len(pauses) == 1, f"the gate closed {len(pauses)} times"
    return {"pause_s": pauses[0], "split_turns": split, "interrupted": pool.gate.interrupted}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-interrupt-") as tmp:
        base = Path(tmp) / "v0"
        init_model(base, seed=0, train_steps=0)
        dirs = [base, perturbed(base, Path(tmp) / "v1", seed=11)]
        arms: dict[str, list[dict[str, Any]]] = {"wait": [], "interrupt": []}
        with start_server(base, max_running_requests=max(8, args.trajectories),
                          weight_version="0") as server:
            version = 0
            for _ in range(args.rounds):
                for arm in ("wait", "interrupt"):
                    version += 1
                    arms[arm].append(await one_sync(
                        server, dirs[version % 2], version, interrupt=arm == "interrupt",
                        tokens=args.tokens, trajectories=args.trajectories, cut=args.cut,
                    ))  # fmt: skip
    wait = statistics.median(r["pause_s"] for r in arms["wait"])
    interrupt = statistics.median(r["pause_s"] for r in arms["interrupt"])
    return {
        "bench": "interrupt",
        "trajectories": args.trajectories,
        "tokens_per_turn": args.tokens,
        "cut": args.cut,
        "rounds": args.rounds,
        "wait_pause_s": [round(r["pause_s"], 4) for r in arms["wait"]],
        "interrupt_pause_s": [round(r["pause_s"], 4) for r in arms["interrupt"]],
        "interrupt_split_turns": [r["split_turns"] for r in arms["interrupt"]],
        "wait_split_turns": [r["split_turns"] for r in arms["wait"]],
        "wait_pause_median_s": round(wait, 4),
        "interrupt_pause_median_s": round(interrupt, 4),
        "interrupt_vs_wait_pause_ratio": round(interrupt / wait, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--cut", type=float, default=0.33)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.tokens < 1000:
        parser.error("--tokens: the bench measures long turns, at least 1000 tokens")
    result = asyncio.run(bench(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
