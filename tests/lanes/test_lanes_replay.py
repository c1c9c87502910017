"""Each lane end to end through the real finalizer and capture worker on Redis, then replayed
from its archive: the replay rebuilds the lane's samples, tensors and artifacts byte for byte.

The trajectories are hand-built DAgger rollins (``tests.lanes.trajectories``) appended as the
evaluator would; the teacher is a deterministic scorer (its force-decode is tested on a real
tinylm server in ``test_dagger_e2e.py``)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.actors.capture import CaptureConfig, CaptureWorker, TeacherScores
from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.client import RolloutClient, collate
from engine.events import EventLog, RolloutReady
from engine.events.catalog import TeacherScored
from engine.ops.replay import (
    archive_rollout,
    decode_entries,
    read_archive,
    replay_state,
    replay_to_dir,
)
from engine.projections.lanes import TEACHER_SENTINEL
from engine.projections.samples import trainer_samples
from engine.projections.summary import ARTIFACT_FILES
from tests.actors.play import plan_events
from tests.lanes.trajectories import completed, request

TRAJECTORIES = [
    [("t", 2), ("o", 1), ("s", 2), ("o", 1), ("t", 1)],
    [("s", 3), ("o", 1), ("t", 4)],
    [("t", 2), ("o", 1), ("s", 1), ("o", 1), ("t", 9)],  # over max_seq_len in the CE lane
    [("s", 2), ("o", 2), ("s", 2)],  # student-only: no CE sub-sample
]


class ScriptedTeacher:
    """Force-decode as a pure function of the tokens: logprob -((t % 7) + 1) / 8, top-3."""

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int
    ) -> TeacherScores:
        lps = [-((t % 7) + 1) / 8 for t in response_ids]
        return lps, [[t, t + 1, t + 2] for t in response_ids], [
            [lp, lp - 1, lp - 2] for lp in lps
        ]


def _digest(batch: dict[str, torch.Tensor]) -> dict[str, tuple[str, list[int], str]]:
    return {
        k: (str(t.dtype), list(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest())
        for k, t in sorted(batch.items())
    }


async def _run_lane(
    log: EventLog, make_log: Any, algorithm: str, tmp_path: Path, **fields: Any
) -> tuple[RolloutReady, dict[str, torch.Tensor], Path]:
    rid = f"lane-{algorithm}"
    req = request(rid, algorithm, len(TRAJECTORIES), n_samples_per_prompt=1, **fields)
    await log.append(log.names.control, req)
    events, _admissions = plan_events(req, evaluator_id="dagger")
    stream = log.names.rollout(rid)
    await log.append_many([(stream, ev) for ev in events])
    await log.append_many(
        [(stream, completed(rid, i, turns)) for i, turns in enumerate(TRAJECTORIES)]
    )
    stop = asyncio.Event()
    capture = CaptureWorker(
        make_log(producer="test", block_ms=100, max_deliveries=3), ScriptedTeacher(),
        CaptureConfig(consumer="c1", heartbeat_ms=50, claim_idle_ms=400, block_ms=100),
    )
    task = asyncio.create_task(capture.run(stop))
    live = tmp_path / "live"
    finalizer = Finalizer(
        make_log(producer="test", block_ms=100, max_deliveries=3),
        FinalizerConfig(consumer="f1", out_dir=live, heartbeat_ms=50, claim_idle_ms=400,
                        block_ms=100),
    )
    try:
        ready = await asyncio.wait_for(finalizer.follow(rid), 30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert isinstance(ready, RolloutReady)
    batch = collate(await RolloutClient(log).load(rid))
    # the replay, from an archive of the stream
    archive = tmp_path / f"{rid}.rollout"
    await archive_rollout(log, rid, archive)
    envs, undecodable = decode_entries(stream, read_archive(archive).entries)
    assert undecodable == 0
    state = replay_state(envs)
    replayed = collate(trainer_samples(state))
    assert _digest(replayed) == _digest(batch)
    out = tmp_path / "replay"
    replay_to_dir(state, out)
    for name in ARTIFACT_FILES:
        assert (out / name).read_bytes() == (live / rid / name).read_bytes(), name
    return ready, batch, live / rid


async def test_the_plain_lane_replays(log: EventLog, make_log: Any, tmp_path: Path) -> None:
    ready, batch, _ = await _run_lane(log, make_log, "grpo", tmp_path)
    assert ready.gbs_scale == 1.0 and len(ready.sample_ids) == 4
    assert "teacher_log_probs" not in batch and "teacher_topk_ids" not in batch


async def test_the_per_token_lane_replays(log: EventLog, make_log: Any, tmp_path: Path) -> None:
    ready, batch, _ = await _run_lane(log, make_log, "opd", tmp_path)
    assert batch["teacher_topk_ids"].shape == (*batch["tokens"].shape, 3)
    assert torch.equal(batch["loss_mask"], batch["action_mask"])
    assert batch["teacher_log_probs"].le(0).all()
    stream = log.names.rollout("lane-opd")
    scored = [e.event for e in (await log.read_after(stream, "0-0"))[0]
              if isinstance(e.event, TeacherScored)]
    assert len(scored) == 4 and all(len(t.action_mask) for t in scored)


async def test_the_mixed_lane_replays(log: EventLog, make_log: Any, tmp_path: Path) -> None:
    _, batch, _ = await _run_lane(log, make_log, "mixed_ce_k3", tmp_path)
    teacher = batch["is_teacher_mask"].bool()
    assert teacher.any()
    assert batch["teacher_log_probs"][teacher].eq(TEACHER_SENTINEL).all()
    assert batch["teacher_log_probs"][~teacher].le(0).all()
    trained = batch["loss_mask"].bool()
    assert torch.equal(trained, batch["action_mask"].bool() | teacher)


async def test_the_ce_lane_replays(log: EventLog, make_log: Any, tmp_path: Path) -> None:
    limit = 3 + 11  # prompt 3: trajectory 2's second sub-sample (17 tokens) is too long
    ready, batch, _ = await _run_lane(
        log, make_log, "dagger_ce", tmp_path, knobs={"max_seq_len": limit}
    )
    assert ready.dropped_sample_ids == ["lane-dagger_ce:s2"]
    # trajectory 0: 2 sub-samples, 1: 1, 3: none (student-only) -> 3 over 2 tasks
    assert ready.gbs_scale == pytest.approx(1.5)
    assert batch["tokens"].shape[0] == 3
    assert "teacher_log_probs" not in batch
    assert torch.equal(batch["loss_mask"].bool(), batch["loss_mask"].bool() & batch[
        "is_teacher_mask"
    ].bool())
