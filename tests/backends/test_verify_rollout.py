"""The verification boundary through the engine: in-process evaluator workers and finalizers
on Redis, a real tinylm server to re-score on, and the scripted agent of ``tests/actors``.

The scripted agent's logprobs are made up (``tests/actors/fixtures/agents.py``), so a
re-score on the real server differs from them: exactly a server whose re-score disagrees with
what was recorded. Past the threshold the rollout fails with the numbers; under a threshold
above those deltas it is ready, with the checks folded into its metrics.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.actors.verify import VerifyPolicy, selected
from engine.backends.pool import BackendPool
from engine.client import RolloutClient
from engine.errors import RolloutFailed
from engine.events import EventLog, SampleCompleted, SampleVerified
from engine.ops.replay import replay_state
from engine.projections.summary import build_summary
from tests.rig import (  # noqa: F401, F811  (fixtures)
    BLOCK_MS,
    CLAIM_IDLE_MS,
    HEARTBEAT_MS,
    Engine,
    engine,
    events_of,
    specs,
    start_rollout,
)
from tinylm.server import TinyLMServer, start_server


@pytest.fixture(scope="module")
def server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    # No --weight-version: the server reports SGLang's "default" until the worker labels it
    # version 0, the version the scripted agent records its tokens at: the same, so they are
    # compared.
    with start_server(tinylm_dir, max_running_requests=4) as srv:
        yield srv


def start_worker(eng: Engine, url: str, verify: VerifyPolicy) -> None:
    pool = BackendPool(url)
    worker = EvaluatorWorker(
        eng.make_log(),
        eng.specs,
        WorkerConfig(
            worker_id="w1",
            evaluator_ids=("scripted",),
            heartbeat_ms=HEARTBEAT_MS,
            claim_idle_ms=CLAIM_IDLE_MS,
            block_ms=BLOCK_MS,
            grace_s=5.0,
            verify=verify,
        ),
        backends=pool,
    )

    async def run() -> None:
        try:
            await worker.run(eng.stop)
        finally:
            await pool.aclose()

    eng.tasks.append(asyncio.create_task(run()))


async def test_a_rollout_past_the_threshold_fails_naming_sample_position_and_delta(
    engine: Engine,  # noqa: F811
    log: EventLog,
    server: TinyLMServer,
) -> None:
    start_worker(engine, server.url, VerifyPolicy(fraction=1.0))
    engine.start_finalizer()
    await start_rollout(log, "vr1", n_prompts=2, script=lambda i: {"turns": 2, "version": 0})
    with pytest.raises(RolloutFailed) as failed:
        await asyncio.wait_for(RolloutClient(log).wait_ready("vr1"), 60)
    reason = str(failed.value)
    assert "verification boundary" in reason
    match = re.search(
        r"sample (\S+) .*weight version 0 .*max \|delta logprob\| = (\S+) at response token "
        r"position (\d+), over the threshold 0\.001",
        reason,
    )
    assert match, reason
    sample_id, delta, position = match.group(1), float(match.group(2)), int(match.group(3))
    verified = {e.sample_id: e for e in await events_of(log, log.names.rollout("vr1"),
                                                          SampleVerified)}  # fmt: skip
    worst = verified[sample_id]
    assert worst.exceeded and worst.position == position
    assert delta == pytest.approx(worst.max_abs_delta, rel=1e-5) and delta > 1e-3


async def test_under_the_threshold_the_checks_fold_into_rollout_ready(
    engine: Engine,  # noqa: F811
    log: EventLog,
    server: TinyLMServer,
) -> None:
    # The request's knobs override the worker's policy (off here).
    start_worker(engine, server.url, VerifyPolicy(fraction=0.0))
    engine.start_finalizer()
    knobs: dict[str, Any] = {"verify_fraction": 1.0, "verify_threshold": 1e9}
    await start_rollout(log, "vr2", n_prompts=3, knobs=knobs,
                        script=lambda i: {"turns": 2, "version": 0})
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("vr2"), 60)
    stream = log.names.rollout("vr2")
    verified = await events_of(log, stream, SampleVerified)
    assert sorted(e.sample_id for e in verified) == sorted(ready.sample_ids)
    assert not any(e.exceeded for e in verified)
    assert ready.metrics["verify/selected"] == 3 == ready.metrics["verify/checked"]
    assert ready.metrics["verify/max_abs_delta"] == max(e.max_abs_delta for e in verified)
    assert ready.metrics["verify/tokens"] == sum(e.n_tokens for e in verified) > 0
    # ... and into the rollout's summary.json (as replay renders it from the same events).
    summary = build_summary(replay_state(await log.read_all(stream)))
    assert summary["verify"]["checked"] == 3 and summary["verify"]["skipped"] == 0
    # Each check is in the log before its sample's SampleCompleted.
    order = [
        (type(env.event).__name__, env.event.sample_id)
        for env in await log.read_all(stream)
        if isinstance(env.event, SampleVerified | SampleCompleted)
    ]
    for sid in ready.sample_ids:
        assert order.index(("SampleVerified", sid)) < order.index(("SampleCompleted", sid))


async def test_the_fraction_picks_the_same_samples_by_id(
    engine: Engine,  # noqa: F811
    log: EventLog,
    server: TinyLMServer,
) -> None:
    start_worker(engine, server.url, VerifyPolicy(fraction=0.5, threshold=1e9))
    engine.start_finalizer()
    await start_rollout(log, "vr3", n_prompts=8, script=lambda i: {"turns": 1})
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("vr3"), 60)
    verified = await events_of(log, log.names.rollout("vr3"), SampleVerified)
    expected = sorted(s for s in ready.sample_ids if selected(s, 0.5))
    assert sorted(e.sample_id for e in verified) == expected
    assert 0 < len(expected) < 8  # this set of ids splits: the test tells picked from not
    assert ready.metrics["verify/selected"] == len(expected)
