"""A weight sync holds admission back for the policy's rollouts, not for an eval pinned to a
version: its episodes run on servers serving that version, which no sync touches."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.events import BatchAdmitted, EventLog, PolicyVersionPublished, QuiesceRequested
from engine.events.base import Envelope
from tests.scheduler.helpers import (
    FakeEvaluators,
    layout,
    load_specs,
    make_scheduler,
    request,
    running,
    write_config,
)

CLUSTER = {"n0": {"gpus": [0, 1, 2, 3], "cpu": 32, "memory_gb": 128}}


async def test_a_pinned_eval_is_admitted_while_a_sync_holds_training_back(
    log: EventLog, tmp_path: Path
) -> None:
    config = write_config(tmp_path, {"m": ("math", 3)}, {"e": ("math", 3)})
    scheduler = make_scheduler(log, config, load_specs(), layout(CLUSTER))
    control = log.names.control
    # Given a sync to version 1 in progress (the syncer never finishes it here),
    await log.append(control, PolicyVersionPublished(version=1, weights_uri="file:///w"))
    await log.append(control, QuiesceRequested(reason="weight sync", version=1))
    # when a training rollout and an eval pinned to version 0 are requested,
    await log.append(control, request("train", n_prompts=3, policy_version=1))
    await log.append(control, request("pinned", n_prompts=3, kind="eval", pinned_version=0))
    evaluators = FakeEvaluators(log, ["math"])

    async def pinned_admitted(admitted: list[Envelope]) -> bool:
        return any(isinstance(e.event, BatchAdmitted) and e.event.rollout_id == "pinned"
                   for e in admitted)

    async with running([scheduler]):
        async with asyncio.timeout(20):
            admitted = await evaluators.run(pinned_admitted)
        await asyncio.sleep(0.5)  # time for a wrongly admitted training batch to show
        admitted += [e for e in await log.read_all(log.names.work("math"))
                     if e.id not in {a.id for a in admitted}]
    # then the eval's batches are admitted and the training rollout's wait for the sync.
    rollouts = {e.event.rollout_id for e in admitted if isinstance(e.event, BatchAdmitted)}
    assert rollouts == {"pinned"}
