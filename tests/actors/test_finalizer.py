"""The finalizer's shell and the capture lane, in-process on both Redis backends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from engine.actors.capture import BackendScorer, CaptureConfig, CaptureWorker, TeacherScores
from engine.backends.teacher import TeacherBackend, TeacherConfig
from engine.client import RolloutClient
from engine.errors import BackendUnavailable, RolloutFailed
from engine.events import (
    CaptureRequested,
    EventLog,
    FilterSpec,
    RolloutReady,
    TeacherScored,
)
from engine.events import (
    RolloutFailed as RolloutFailedEvent,
)
from engine.events.log import DeadEntry
from engine.projections.summary import ARTIFACT_FILES
from tests.rig import Engine, events_of, start_rollout, wait_state


async def test_two_finalizers_append_one_rollout_ready(engine: Engine, log: EventLog) -> None:
    # Two finalizers follow the same rollout (as after a claim, or a restart) and race to
    # decide it the moment the last sample ends: compare-and-append lets one win.
    engine.start_worker()
    f1, f2 = engine.finalizer("f1"), engine.finalizer("f2")
    follows = [asyncio.create_task(f.follow("r1")) for f in (f1, f2)]
    await start_rollout(log, "r1", n_prompts=6, per_prompt=2, script=lambda i: {"reward": i % 3})
    first, second = await asyncio.wait_for(asyncio.gather(*follows), 30)
    assert first == second
    assert len(await events_of(log, log.names.rollout("r1"), RolloutReady)) == 1
    assert len(await events_of(log, log.names.control, RolloutReady)) == 1
    # A finalizer (re)started after the decision finds it and appends nothing.
    again = await asyncio.wait_for(engine.finalizer("f3").follow("r1"), 10)
    assert again == first
    assert len(await events_of(log, log.names.rollout("r1"), RolloutReady)) == 1


async def test_finalizers_in_one_group_share_the_requests(engine: Engine, log: EventLog) -> None:
    engine.start_worker()
    engine.start_finalizer("f1")
    engine.start_finalizer("f2")
    for rid in ("a", "b", "c"):
        await start_rollout(log, rid, n_prompts=2)
    client = RolloutClient(log)
    for rid in ("a", "b", "c"):
        await asyncio.wait_for(client.wait_ready(rid), 30)
    ready = await events_of(log, log.names.control, RolloutReady)
    assert sorted(r.rollout_id for r in ready) == ["a", "b", "c"]


async def test_a_finalizer_follows_a_bounded_number_of_rollouts(
    engine: Engine, log: EventLog
) -> None:
    # Three requests wait in the group before the finalizer starts, and no worker runs, so
    # no rollout can end: a finalizer bounded to one takes exactly one of them (one read
    # of the group would otherwise take all three at once) and the others stay undelivered.
    for rid in ("x", "y", "z"):
        await start_rollout(log, rid, n_prompts=1)
    control = log.names.control
    await log.ensure_group(control, "finalizers")
    finalizer = engine.start_finalizer("f1", max_rollouts=1)
    while await log.pending_count(control, "finalizers") == 0:
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # several block windows: time for a second fetch to happen
    held = await log.unread_own_pending("finalizers", "f1", control)
    assert len(held.deliveries) == 1 and await log.pending_count(control, "finalizers") == 1
    assert len(finalizer._following) == 1
    # With a worker the rollouts end and the waiting requests are followed one by one.
    engine.start_worker()
    client = RolloutClient(log)
    for rid in ("x", "y", "z"):
        await asyncio.wait_for(client.wait_ready(rid), 30)


async def test_filters_reach_the_trainer(engine: Engine, log: EventLog) -> None:
    engine.start_worker()
    engine.start_finalizer()
    rewards = {0: 1, 1: 0, 2: 1, 3: 1, 4: 0, 5: 1}  # groups of 2: mixed, equal, mixed
    await start_rollout(
        log, "rf", n_prompts=3, per_prompt=2,
        filters=FilterSpec(reject_equal_rewards=True, finish_only=True),
        script=lambda i: {"reward": rewards[i], **({"reason": "max_turns"} if i == 5 else {})},
    )
    client = RolloutClient(log)
    ready = await asyncio.wait_for(client.wait_ready("rf"), 30)
    assert ready.sample_ids == ["rf:s0", "rf:s1", "rf:s4"]
    assert ready.dropped_sample_ids == ["rf:s2", "rf:s3", "rf:s5"]
    assert [s.sample_id for s in await client.load("rf")] == ready.sample_ids


async def test_an_emptied_rollout_loads_as_one_masked_dummy(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(
        log, "rd", n_prompts=2, per_prompt=2, filters=FilterSpec(reject_equal_rewards=True)
    )
    client = RolloutClient(log)
    ready = await asyncio.wait_for(client.wait_ready("rd"), 30)
    assert ready.dummy and ready.sample_ids == []
    (dummy,) = await client.load("rd")
    assert dummy.remove_sample and dummy.tokens == (0, 0) and dummy.loss_mask == (0, 0)


async def test_artifacts_written_when_ready(
    engine: Engine, log: EventLog, tmp_path: Path
) -> None:
    engine.start_worker()
    follow = asyncio.create_task(engine.finalizer(out_dir=tmp_path).follow("ra"))
    await start_rollout(log, "ra", n_prompts=2, per_prompt=2)
    ready = await asyncio.wait_for(follow, 30)  # returns once the files are written
    assert isinstance(ready, RolloutReady)
    assert sorted(p.name for p in (tmp_path / "ra").iterdir()) == sorted(ARTIFACT_FILES)


class FakeTeacher:
    """Deterministic force-decode: logprob -(token % 5)/4, top-2 ids token and token+1."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls = 0

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], top_k: int
    ) -> TeacherScores:
        self.calls += 1
        if self.fail:
            raise BackendUnavailable("http://teacher:30000 refused the connection")
        lps = [-(t % 5) / 4 for t in response_ids]
        return lps, [[t, t + 1] for t in response_ids], [[lp, lp - 1] for lp in lps]


async def test_teacher_capture_lane(engine: Engine, log: EventLog) -> None:
    engine.start_worker()
    engine.start_finalizer()
    teacher = FakeTeacher()
    capture = CaptureWorker(
        engine.make_log(), teacher,
        CaptureConfig(consumer="c1", heartbeat_ms=50, claim_idle_ms=400, block_ms=100),
    )
    engine.tasks.append(asyncio.create_task(capture.run(engine.stop)))
    await start_rollout(
        log, "rt", n_prompts=3, teacher_capture=True,
        script=lambda i: {"fail": {"phase": "run", "error": "conn"}} if i == 2 else {},
    )
    client = RolloutClient(log)
    ready = await asyncio.wait_for(client.wait_ready("rt"), 30)
    assert ready.sample_ids == ["rt:s0", "rt:s1", "rt:s2"]
    stream = log.names.rollout("rt")
    (request,) = await events_of(log, stream, CaptureRequested)
    assert request.sample_ids == ["rt:s0", "rt:s1"]  # the aborted sample has nothing to score
    scored = {t.sample_id: t for t in await events_of(log, stream, TeacherScored)}
    assert sorted(scored) == ["rt:s0", "rt:s1"] and teacher.calls == 2
    t0 = scored["rt:s0"]
    assert t0.top_k == 2 and len(t0.topk_ids) == 2 * len(t0.teacher_logprobs)
    samples = await client.load("rt")
    s0 = samples[0]
    assert s0.teacher_log_probs == tuple(
        -(t % 5) / 4 for t in s0.tokens[len(s0.tokens) - s0.response_length :]
    )
    assert s0.loss_mask == tuple(t0.action_mask.tolist())
    assert samples[2].remove_sample and samples[2].teacher_log_probs is None


async def test_a_persistent_teacher_failure_fails_the_rollout(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    teacher = FakeTeacher(fail=True)
    capture = CaptureWorker(
        engine.make_log(), teacher,
        CaptureConfig(consumer="c1", heartbeat_ms=50, claim_idle_ms=400, block_ms=100,
                      max_tries=2, retry_pause_s=0.01),
    )
    engine.tasks.append(asyncio.create_task(capture.run(engine.stop)))
    await start_rollout(log, "rx", n_prompts=1, teacher_capture=True)
    client = RolloutClient(log)
    with pytest.raises(RolloutFailed, match="refused the connection"):
        await asyncio.wait_for(client.wait_ready("rx"), 30)
    assert teacher.calls == 2
    state = await wait_state(log, "rx", lambda s: s.failed is not None, timeout=5)
    assert state.ready is None
    (failed,) = await events_of(log, log.names.control, RolloutFailedEvent)
    assert "after 2 tries" in failed.reason


async def test_capture_through_the_teacher_backend(engine: Engine, log: EventLog) -> None:
    """CaptureWorker -> BackendScorer -> TeacherBackend over HTTP (an SGLang-shaped fake)."""
    def sglang(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids, start = body["input_ids"], body["logprob_start_len"]
        k = body.get("top_logprobs_num", 0)
        scored = ids[start:]
        entries = [[None if i == 0 else -t / 1000, t, None] for i, t in enumerate(scored)]
        tops = [None] + [[[-t / 1000, t, None], [-1.0, 0, None]][:k] for t in scored[1:]]
        return httpx.Response(200, json={
            "text": "x",
            "meta_info": {
                "finish_reason": {"type": "length", "length": 1},
                "prompt_tokens": len(ids), "completion_tokens": 1,
                "input_token_logprobs": entries, "input_top_logprobs": tops,
                "output_token_logprobs": [[-0.5, 7, None]], "output_top_logprobs": [None],
            },
        })

    teacher = TeacherBackend(
        config=TeacherConfig(url="http://teacher:30000", top_logprobs_num=2),
        transport=httpx.MockTransport(sglang),
    )
    engine.start_worker()
    engine.start_finalizer()
    capture = CaptureWorker(
        engine.make_log(), BackendScorer(teacher),
        CaptureConfig(consumer="c1", heartbeat_ms=50, claim_idle_ms=400, block_ms=100),
    )
    engine.tasks.append(asyncio.create_task(capture.run(engine.stop)))
    await start_rollout(log, "rh", n_prompts=2, teacher_capture=True)
    client = RolloutClient(log)
    await asyncio.wait_for(client.wait_ready("rh"), 30)
    samples = await client.load("rh")
    for s in samples:
        response = s.tokens[len(s.tokens) - s.response_length :]
        assert s.teacher_log_probs == pytest.approx([-t / 1000 for t in response], abs=1e-6)
    scored = await events_of(log, log.names.rollout("rh"), TeacherScored)
    assert {t.top_k for t in scored} == {2}
    await teacher.aclose()


async def test_a_request_its_finalizers_keep_dropping_fails_the_rollout(
    engine: Engine, log: EventLog
) -> None:
    # Finalizer fA took the request (delivery 1) and died. fB's log allows one delivery:
    # its claim finds the request delivered twice, dead-letters it and fails the rollout,
    # so the trainer waiting for it gets an error instead of waiting forever.
    engine.start_worker()
    await log.ensure_group(log.names.control, "finalizers")
    await start_rollout(
        log, "r11", n_prompts=2, script=lambda i: {"hang_attempts": [1]} if i == 0 else {}
    )
    (taken,) = await log.read_group("finalizers", "fA", [log.names.control], block_ms=50)
    fin_b = engine.finalizer("fB")
    fin_b.log.max_deliveries = 1
    engine.tasks.append(asyncio.create_task(fin_b.run(engine.stop)))
    with pytest.raises(RolloutFailed, match="finalizing gave up.*delivered 2 times"):
        await asyncio.wait_for(RolloutClient(log).wait_ready("r11"), 30)
    (failed,) = await events_of(log, log.names.rollout("r11"), RolloutFailedEvent)
    assert failed.causation == f"{log.names.control}@{taken.id}"
    assert await events_of(log, log.names.rollout("r11"), RolloutReady) == []
    (letter,) = await log.read_all(log.names.dead)
    assert letter.event.source_id == taken.id  # type: ignore[attr-defined]
    await engine.close()
    assert await log.pending_count(log.names.control, "finalizers") == 0


async def test_a_dead_request_does_not_overturn_a_decided_rollout(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    request = await start_rollout(log, "r12", n_prompts=2)
    await asyncio.wait_for(RolloutClient(log).wait_ready("r12"), 30)
    (env,) = [e for e in await log.read_all(log.names.control) if e.event.type == request.type]
    late = engine.finalizer("fLate")
    await late._fail_dead(DeadEntry(env.stream, env.id, "delivered 9 times", 9, env.event))
    assert await events_of(log, log.names.rollout("r12"), RolloutFailedEvent) == []
    assert len(await events_of(log, log.names.rollout("r12"), RolloutReady)) == 1


async def test_a_stopped_finalizer_returns_while_following_a_rollout(
    engine: Engine, log: EventLog
) -> None:
    # Stopping cancels the follow of an unfinished rollout. On redis-server this used to
    # hang: the cancellation landed in redis-py's send (asyncio.wait_for on Python 3.11)
    # and was swallowed, so the follow read on forever.
    engine.start_worker()
    stop = asyncio.Event()
    fin = engine.finalizer("fS")
    run = asyncio.create_task(fin.run(stop))
    await start_rollout(
        log, "r13", n_prompts=2, script=lambda i: {"hang_attempts": [1]} if i == 0 else {}
    )
    await wait_state(log, "r13", lambda s: s.n_terminal == 1)
    stop.set()
    done, _ = await asyncio.wait([run], timeout=10)
    assert done, "the finalizer did not stop"
    assert run.exception() is None
    # the request is left pending for whoever takes over
    assert await log.pending_count(log.names.control, "finalizers") == 1
