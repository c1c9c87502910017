"""Real worker processes on a real redis-server: SIGKILL mid-rollout, SIGTERM hand-back."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.client import RolloutClient, collate
from engine.events import (
    EventLog,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
)
from engine.ops.processes import Processes
from engine.projections.rollout import RolloutState
from tests.rig import (
    EVALUATOR_CONFIG,
    assert_tokens_released_once,
    events_of,
    released_tokens,
    start_finalizer,
    start_rollout,
    start_worker,
    wait_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]

def _hung_started(hung: set[str], n_done: int) -> Callable[[RolloutState], bool]:
    def check(state: RolloutState) -> bool:
        return state.n_terminal == n_done and all(
            (s := state.samples.get(sid)) is not None and s.started for sid in hung
        )

    return check


async def _exit_code(procs: Processes, name: str, timeout: float = 30) -> int:
    return await asyncio.to_thread(procs.wait, name, timeout)


async def test_a_sigkilled_worker_loses_nothing(real_log: EventLog, procs: Processes) -> None:
    log = real_log
    start_finalizer(procs)
    start_worker(procs, "wA", "--max-batches", "4")
    hung = {1, 6, 9}  # one hangs in each of the three batches; the others finish
    await start_rollout(
        log, "rk", n_prompts=12,
        script=lambda i: {"hang_attempts": [1], "turns": 2} if i in hung else {"turns": 2},
    )
    hung_ids = {f"rk:s{i}" for i in hung}
    await wait_state(log, "rk", _hung_started(hung_ids, 9), timeout=60)
    assert procs.kill("wA") == -signal.SIGKILL
    start_worker(procs, "wB")

    client = RolloutClient(log)
    ready = await client.wait_ready("rk", timeout=60)
    assert (ready.n_completed, ready.n_aborted) == (12, 0)

    stream = log.names.rollout("rk")
    completed = await events_of(log, stream, SampleCompleted)
    aborted = await events_of(log, stream, SampleAborted)
    terminals = Counter(ev.sample_id for ev in [*completed, *aborted])
    assert terminals == Counter({f"rk:s{i}": 1 for i in range(12)})  # none lost, none twice
    for ev in completed:
        assert ev.attempt == (2 if ev.sample_id in hung_ids else 1)
    started_by_b = {s.sample_id for s in await events_of(log, stream, SampleStarted)
                    if s.worker == "wB"}
    assert started_by_b == hung_ids
    assert_tokens_released_once(await released_tokens(log, "rk"))
    procs.signal("wB", signal.SIGTERM)  # finishes (and acks) what it runs
    assert await _exit_code(procs, "wB") == 0
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0

    batch = collate(await client.load("rk"))
    assert batch["tokens"].shape == (12, 4 + 8)
    assert "(recovered)" in procs.output("wB")


async def test_sigterm_hands_running_work_back(real_log: EventLog, procs: Processes) -> None:
    log = real_log
    start_finalizer(procs)
    start_worker(procs, "wA", "--grace-s", "0.5")
    await start_rollout(
        log, "rt", n_prompts=4, script=lambda i: {"hang_attempts": [1]} if i == 0 else {}
    )
    await wait_state(log, "rt", _hung_started({"rt:s0"}, 3), timeout=60)
    procs.signal("wA", signal.SIGTERM)
    assert await _exit_code(procs, "wA") == 0  # a clean exit, the batch left pending
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 1
    start_worker(procs, "wB")
    ready = await RolloutClient(log).wait_ready("rt", timeout=60)
    assert ready.n_completed == 4
    assert_tokens_released_once(await released_tokens(log, "rt"))
    for name in ("wB", "fin"):
        procs.signal(name, signal.SIGTERM)
        assert await _exit_code(procs, name) == 0


async def test_through_the_real_scheduler(
    real_log: EventLog, procs: Processes, tmp_path: Path
) -> None:
    """request -> scheduler -> workers -> finalizer -> RolloutReady -> load -> collate."""
    pytest.importorskip("workers.scheduler")
    data = tmp_path / "ds.jsonl"
    data.write_text("".join(f'{{"prompt": "q{i}", "label": "{i}"}}\n' for i in range(8)))
    config = tmp_path / "rollout.yaml"
    config.write_text(
        "rollout:\n  defaults: {task_type: scripted}\n"
        f"  datasets:\n    ds: {{path: {data}, n_samples_per_prompt: 2}}\n"
    )
    layout = '{"node-a": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}'
    procs.start(
        "sched", "scheduler", "--rollout-config", str(config),
        "--evaluator-config", str(EVALUATOR_CONFIG), "--cluster-layout", layout,
        "--scheduler-id", "s1",
    )
    start_worker(procs, "w1")
    start_worker(procs, "w2")
    start_finalizer(procs)
    client = RolloutClient(real_log)
    rid = await client.request(iteration=2, n_prompts=6, n_samples_per_prompt=2, seed=5)
    ready = await client.wait_ready(rid, timeout=60)
    assert (ready.n_completed, ready.n_aborted, len(ready.sample_ids)) == (12, 0, 12)
    samples = await client.load(rid)
    assert [s.index for s in samples] == list(range(12))
    assert {s.group_index for s in samples} == set(range(6))
    assert all(s.prompt == samples[2 * s.group_index].prompt for s in samples)
    batch = collate(samples)
    assert batch["tokens"].shape == (12, 8) and batch["loss_mask"].sum().item() == 12 * 4
    stream = real_log.names.rollout(rid)
    terminals = Counter(ev.sample_id for ev in await events_of(real_log, stream, SampleCompleted))
    assert set(terminals.values()) == {1} and len(terminals) == 12
    assert_tokens_released_once(await released_tokens(real_log, rid))


def _running(marker: str) -> bool:
    """Whether a process whose command line holds ``marker`` is alive."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and b"sleep" in cmdline:
            return True
    return False


async def test_the_claiming_worker_reaps_the_dead_workers_sandbox(
    real_log: EventLog, procs: Processes, request: pytest.FixtureRequest
) -> None:
    log = real_log
    marker = f"reap-me-{os.getpid()}"
    # A root under /tmp: sandboxes run as their own uid, which cannot enter pytest's tmp_path.
    root = Path(tempfile.mkdtemp(prefix="sbx-"))
    request.addfinalizer(lambda: shutil.rmtree(root, ignore_errors=True))
    start_finalizer(procs)
    start_worker(procs, "wA", "--sandbox", "local", "--sandbox-root", str(root))
    await start_rollout(
        log, "rs", n_prompts=2,
        script=lambda i: {"sandbox_hang_attempts": [1], "marker": marker} if i == 0 else {},
    )

    async def sandbox_running() -> None:
        while not _running(marker):
            await asyncio.sleep(0.05)

    await asyncio.wait_for(sandbox_running(), 30)
    assert procs.kill("wA") == -signal.SIGKILL
    assert _running(marker)  # the dead worker's sandbox outlives it
    start_worker(procs, "wB", "--sandbox", "local", "--sandbox-root", str(root))
    ready = await RolloutClient(log).wait_ready("rs", timeout=60)
    assert ready.n_completed == 2
    assert not _running(marker)
    assert "reaped 1 sandboxes wA left for batch rs:b0" in procs.output("wB")
