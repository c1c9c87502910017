"""One per-sample view: the row the evaluator's progress callback hears is the row the
summaries count, eval_details lists and the trainer sample takes its outcome from."""

from __future__ import annotations

import asyncio
from typing import Any

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.events import EventLog
from engine.outcomes import AbortClass, FailureClass, SampleStatus, TerminationReason
from engine.projections.rows import SampleRow, sample_rows
from engine.projections.samples import trainer_samples
from tests.rig import (
    BLOCK_MS,
    CLAIM_IDLE_MS,
    HEARTBEAT_MS,
    Engine,
    start_rollout,
    wait_rollout,
)


async def test_progress_rows_are_the_rows_of_the_log(engine: Engine, log: EventLog) -> None:
    heard: list[SampleRow] = []
    worker = EvaluatorWorker(
        engine.make_log(),
        engine.specs,
        WorkerConfig(worker_id="w1", evaluator_ids=("scripted",), heartbeat_ms=HEARTBEAT_MS,
                     claim_idle_ms=CLAIM_IDLE_MS, block_ms=BLOCK_MS, grace_s=5.0),
        on_task_done=heard.append,
    )
    engine.tasks.append(asyncio.create_task(worker.run(engine.stop)))
    engine.start_finalizer()
    scripts: dict[int, dict[str, Any]] = {
        1: {"fail": {"phase": "run", "error": "sandbox"}},
        2: {"reason": "max_turns", "reward": 0},
        3: {"reason": "infra_conn"},
    }
    await start_rollout(log, "rw", n_prompts=4, script=lambda i: {"turns": 2, **scripts.get(i, {})})
    rollout = await wait_rollout(log, "rw", lambda s: s.ready is not None)

    rows = sample_rows(rollout)
    assert sorted(heard, key=lambda r: r.index) == rows
    by_index = {r.index: r for r in rows}
    assert by_index[0].completed and by_index[0].status is SampleStatus.COMPLETED
    assert by_index[1].aborted and by_index[1].abort_class is AbortClass.INFRA_SANDBOX
    assert by_index[2].failure_class is FailureClass.TRUNCATED_TURNS
    assert by_index[3].termination_reason is TerminationReason.INFRA_CONN
    assert by_index[3].agent_reason is TerminationReason.INFRA_CONN
    assert all(r.batch_id for r in rows)

    samples = {s.index: s for s in trainer_samples(rollout)}
    for r in rows:
        assert (samples[r.index].status, samples[r.index].termination_reason) == (
            r.status, r.termination_reason
        )
