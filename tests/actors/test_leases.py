"""Leases on real worker processes and a real redis-server: a batch that waits for a free slot
while the worker's other slot hangs is kept alive, so the other worker never claims it, no
sample runs twice, and no sandbox is reaped under the worker still running it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.events import EventLog, SampleAborted, SampleCompleted, SampleStarted
from engine.ops.processes import Processes
from tests.rig import FIXTURES, events_of, start_rollout, wait_state

pytestmark = [pytest.mark.slow, pytest.mark.redis_server]

CONFIG = FIXTURES / "lease_evaluators.py"
GROUP = "evaluators"


@pytest.fixture
def sandbox_root() -> Iterator[Path]:
    # Under /tmp: sandboxes run as their own uid, which cannot enter pytest's tmp_path.
    root = Path(tempfile.mkdtemp(prefix="sbx-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


async def _holds(log: EventLog, worker: str, *, timeout: float = 60) -> None:
    """Wait until ``worker`` holds one entry of each work stream (read without a delivery)."""
    streams = [log.names.work(e) for e in ("hang", "wait")]
    for stream in streams:
        await log.ensure_group(stream, GROUP)

    async def held() -> None:
        while True:
            counts = [
                len((await log.unread_own_pending(GROUP, worker, s)).entries) for s in streams
            ]
            if counts == [1, 1]:
                return
            await asyncio.sleep(0.05)

    await asyncio.wait_for(held(), timeout)


async def _admit(log: EventLog, name: str, hold: Path) -> None:
    """A batch whose samples hang until ``hold`` exists (a model server that stops and comes
    back), and one whose samples run a command in a sandbox."""
    await start_rollout(log, f"h{name}", n_prompts=4, evaluator_id="hang",
                        script=lambda i: {"hold_file": str(hold)})
    await start_rollout(log, f"w{name}", n_prompts=4, evaluator_id="wait",
                        script=lambda i: {"sandbox_command": "sleep 1.5; echo ok"})


async def test_a_batch_waiting_for_a_slot_is_neither_claimed_nor_run_twice(
    real_log: EventLog, procs: Processes, sandbox_root: Path, tmp_path: Path
) -> None:
    # Given two workers, each serving both evaluators with one slot: each read one batch of
    # each evaluator at once, runs the hanging one and keeps the other waiting for its slot,
    log = real_log
    holds = {w: tmp_path / f"hold-{w}" for w in ("A", "B")}
    settings = {"evaluator_config": CONFIG, "evaluators": "hang,wait", "max_batches": 1,
                "sandbox": "local", "sandbox_root": sandbox_root}
    for w in ("A", "B"):
        await _admit(log, w, holds[w])
        procs.start(f"w{w}", "worker", settings={"worker_id": f"w{w}", **settings})
        await _holds(log, f"w{w}")
    # when the hang outlasts the claim window (1 s) twice over, and the servers come back
    # one after the other, wB's first (its claim round would find wA's waiting batch, the
    # oldest, idle if wA did not keep it alive),
    await asyncio.sleep(2.5)
    holds["B"].touch()
    await asyncio.sleep(1.0)
    holds["A"].touch()
    # then every rollout completes, each sample started once, by the worker that read it,
    # with its sandbox command run to the end (a reaped sandbox fails the sample).
    for rid in ("hA", "wA", "hB", "wB"):
        state = await wait_state(log, rid, lambda s: s.n_terminal == 4, timeout=90)
        stream = log.names.rollout(rid)
        assert await events_of(log, stream, SampleAborted) == []
        started = await events_of(log, stream, SampleStarted)
        assert Counter(s.sample_id for s in started) == Counter(state.samples.keys())
        assert {(s.worker, s.attempt) for s in started} == {(f"w{rid[1]}", 1)}
        if rid.startswith("w"):
            texts = {c.response_text for c in await events_of(log, stream, SampleCompleted)}
            assert texts == {"exit=0 out=ok"}
    for w in ("wA", "wB"):
        output = procs.output(w)
        assert "recovers batch" not in output and "reaped" not in output, output[-2000:]
