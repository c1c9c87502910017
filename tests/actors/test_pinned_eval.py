"""An eval pinned to a weight version while training goes on (``RolloutRequested.
pinned_version``): the request is checked when it is made, the summary records the version,
and with real processes -- a redis-server, a tinylm policy server, an eval server run by
``rollout serve --role eval``, the engine's worker, syncer and finalizer -- a sync of the policy
server to version 2 lands while an eval pinned at version 0 is in a generate call on the eval
server, without waiting for it; every eval turn is of version 0, training moves on, and the
eval's summary says 0. The policy is at version 1 before the eval starts, so that only the
eval server serves version 0 (a policy server still at the pinned version is the unit tests'
case, tests/backends/test_pinned_routing.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pydantic
import pytest

from engine.events import (
    EventLog,
    PolicyVersionActivated,
    PolicyVersionPublished,
    RolloutReady,
    RolloutRequested,
    TurnCompleted,
)
from engine.events.catalog.servers import ServerRegistered
from engine.ops.replay import replay_state
from engine.ops.tinylm import RL_SERVER_ENV
from engine.projections.summary import build_summary
from tests.actors.play import play_scheduler
from tests.ops.test_discovery import until_running
from tests.redis_server import RedisServer
from tests.rig import launcher

CONFIG = Path(__file__).parent / "fixtures" / "pinned_evaluators.py"


def test_a_pinned_version_is_for_eval_requests_without_a_staleness_bound() -> None:
    RolloutRequested(rollout_id="ev", n_prompts=1, kind="eval", pinned_version=3)
    with pytest.raises(pydantic.ValidationError, match="pinned_version=3 is for eval requests"):
        RolloutRequested(rollout_id="tr", n_prompts=1, pinned_version=3)
    with pytest.raises(pydantic.ValidationError, match="pinned_version and max_staleness"):
        RolloutRequested(rollout_id="ev", n_prompts=1, kind="eval", pinned_version=3,
                         max_staleness=1)  # fmt: skip


async def control_until(log: EventLog, found: Callable[[list[Any]], Any],
                        timeout: float = 120.0) -> Any:  # fmt: skip
    async def wait() -> Any:
        while True:
            hit = found([e.event for e in await log.read_all(log.names.control)])
            if hit:
                return hit
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(wait(), timeout)


def ready(rollout_id: str) -> Callable[[list[Any]], Any]:
    return lambda evs: next(
        (e for e in evs if isinstance(e, RolloutReady) and e.rollout_id == rollout_id), None
    )


async def publish(
    log: EventLog, version: int, weights: Path, timeout: float = 120.0
) -> PolicyVersionActivated:
    """Publish ``version`` and return its activation (``TimeoutError`` past ``timeout``)."""
    published = PolicyVersionPublished(version=version, weights_uri=f"file://{weights}")
    await log.append(log.names.control, published)

    def activated(evs: list[Any]) -> PolicyVersionActivated | None:
        found = (e for e in evs if isinstance(e, PolicyVersionActivated) and e.version == version)
        return next(found, None)

    result: PolicyVersionActivated = await control_until(log, activated, timeout)
    return result


async def turn_versions(log: EventLog, rollout_id: str) -> list[int | None]:
    entries = await log.read_all(log.names.rollout(rollout_id))
    return [e.event.weight_version for e in entries if isinstance(e.event, TurnCompleted)]


@pytest.mark.redis_server
@pytest.mark.slow
async def test_a_sync_lands_while_an_eval_pinned_at_v0_runs_on_the_eval_server(
    real_log: EventLog, redis_server: RedisServer, tinylm_dir: Path, tmp_path: Path
) -> None:
    log = real_log
    ckpt = {v: tmp_path / "ckpt" / f"v{v}" for v in range(3)}
    for path in ckpt.values():
        shutil.copytree(tinylm_dir, path)
    with launcher(redis_server.url, tmp_path / "logs", outage_limit_s=120.0) as procs:
        # Everything starts at once; the worker and the syncer find the servers on the log.
        procs.start("serve-eval", "serve", settings={
            "model_dir": ckpt[0], "serve_role": "eval",
            "serve_weight_version": 0, "serve_log_dir": tmp_path / "servers"})  # fmt: skip
        procs.start("w1", "worker", settings={
            "worker_id": "w1", "evaluator_config": CONFIG, "evaluators": "versions",
            "sandbox": "none", "servers_from_log": True, "stall_s": 300.0})  # fmt: skip
        procs.start("sync", "sync", settings={"servers_from_log": True})
        procs.start("fin", "finalizer", settings={"worker_id": "fin"})
        policy = procs.serve_tinylm("policy", tinylm_dir, "--weight-version", "0",
                                    env=RL_SERVER_ENV).url  # fmt: skip
        await log.append(log.names.control, ServerRegistered(
            endpoint=policy, backend="tinylm", supervisor="test", weight_version=0))  # fmt: skip
        (reg,) = await control_until(log, lambda evs: [
            e for e in evs if isinstance(e, ServerRegistered) and e.role == "eval"])  # fmt: skip
        assert reg.weight_version == 0 and reg.pid is not None
        cmdline = Path(f"/proc/{reg.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--model-path") + 1] == str(ckpt[0]).encode()

        # The policy moves to version 1 (the syncer loads the policy server only), so only
        # the eval server serves version 0.
        assert (await publish(log, 1, ckpt[1])).servers == [policy]

        # An eval pinned at version 0 runs on the eval server, which is then stopped (SIGSTOP)
        # with one of its generate calls in flight, or about to be.
        ev = RolloutRequested(rollout_id="ev", kind="eval", n_prompts=2, n_samples_per_prompt=2,
                              pinned_version=0)  # fmt: skip
        await log.append(log.names.control, ev)
        await play_scheduler(log, ev, evaluator_id="versions", batch_size=16,
                             script=lambda i: {"max_new_tokens": 64})  # fmt: skip
        await until_running(reg.endpoint, "ev")
        os.kill(reg.pid, signal.SIGSTOP)
        try:
            # When version 2 is published, the policy server is synced to it: the sync
            # neither waits for the eval's call nor holds it (the worker's stall_s is far
            # longer than this wait: nothing else could end that call meanwhile).
            assert (await publish(log, 2, ckpt[2], timeout=60)).servers == [policy]
            now = [e.event for e in await log.read_all(log.names.control)]
            assert ready("ev")(now) is None  # its call is still on the stopped eval server
        finally:
            os.kill(reg.pid, signal.SIGCONT)

        # Then training runs at version 2 while the eval finishes at 0, and says so.
        tr = RolloutRequested(rollout_id="tr", n_prompts=2, n_samples_per_prompt=2,
                              policy_version=2)  # fmt: skip
        await log.append(log.names.control, tr)
        await play_scheduler(log, tr, evaluator_id="versions", batch_size=16)
        done = await control_until(log, ready("ev"), 180)
        assert await control_until(log, ready("tr"), 180)
        procs.check_alive()
        eval_versions = await turn_versions(log, "ev")
        assert len(eval_versions) == 12 and set(eval_versions) == {0}
        assert set(await turn_versions(log, "tr")) == {2}
        assert set(done.version_tokens) == {"0"}
        envs = await log.read_all(log.names.rollout("ev"))
        summary = build_summary(replay_state(envs))
        assert summary["pinned"] == {"version": 0, "version_tokens": done.version_tokens}
        assert summary["kind"] == "eval" and summary["counts"]["success"] == 2
