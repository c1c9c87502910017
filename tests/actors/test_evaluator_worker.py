"""Evaluator workers in-process: outcomes, abort classes, tokens, recovery, dead letters."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import pytest

from engine.actors.batch_run import sample_seed
from engine.actors.evaluator_worker import EvaluatorWorker, WorkerConfig
from engine.agents.binding import EvaluatorBinding
from engine.client import RolloutClient
from engine.errors import LogUnavailable, OutageExceeded
from engine.events import (
    AbortClass,
    BatchLeased,
    EventLog,
    RolloutKind,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TokenReleased,
    TurnCompleted,
)
from engine.events.ids import parse_id
from engine.projections.rollout import RolloutState
from engine.sample import DUMMY_TOKENS
from tests.actors.fixtures.agents import PEAK, logprobs, prompt_ids, response_ids
from tests.conftest import write_raw
from tests.rig import (
    Engine,
    assert_tokens_released_once,
    events_of,
    released_tokens,
    start_rollout,
    wait_state,
)


def _all_done(state: RolloutState) -> bool:
    return state.all_terminal()


async def test_a_rollout_completes_with_trajectories_turns_and_tokens(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(
        log, "r1", n_prompts=3, per_prompt=2, script=lambda i: {"turns": 2, "reward": i % 2}
    )
    client = RolloutClient(log)
    ready = await asyncio.wait_for(client.wait_ready("r1"), 30)
    assert ready.sample_ids == [f"r1:s{i}" for i in range(6)]
    assert (ready.n_completed, ready.n_aborted, ready.policy_version) == (6, 0, 3)

    samples = await client.load("r1")
    s3 = samples[3]
    assert s3.tokens == (*prompt_ids(3), *response_ids(3, 8))
    assert s3.response_length == 8 and s3.loss_mask == (1,) * 8
    assert s3.rollout_log_probs == logprobs(8)
    assert s3.reward == 1.0 and s3.status == "completed" and not s3.remove_sample
    assert s3.metadata["dataset"] == "ds" and s3.policy_version == 3

    stream = log.names.rollout("r1")
    turns = await events_of(log, stream, TurnCompleted)
    assert len(turns) == 12
    assert {(t.node, t.gpu) for t in turns} <= {("node-a", 0), ("node-b", 1)}
    started = await events_of(log, stream, SampleStarted)
    assert sorted(s.sample_id for s in started) == sorted(ready.sample_ids)
    assert {s.attempt for s in started} == {1} and {s.worker for s in started} == {"w1"}
    assert_tokens_released_once(await released_tokens(log, "r1"))
    await engine.close()  # a stopping worker finishes (and acks) what it runs
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0


async def test_episodes_get_knobs_stopping_and_a_seed_per_sample(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(
        log, "rk", n_prompts=1, per_prompt=3, knobs={"dagger_beta": 0.25}, seed=9,
        stopping={"max_turns": 7},
    )
    await asyncio.wait_for(RolloutClient(log).wait_ready("rk"), 30)
    done = await events_of(log, log.names.rollout("rk"), SampleCompleted)
    metrics = {d.sample_id: d.metrics for d in done}
    assert {m["dagger_beta"] for m in metrics.values()} == {0.25}
    assert {m["max_turns"] for m in metrics.values()} == {7.0}
    seeds = [metrics[f"rk:s{i}"]["seed"] for i in range(3)]
    assert seeds == [float(sample_seed(9, i)) for i in range(3)] and len(set(seeds)) == 3


async def test_eval_episodes_run_student_only_unless_an_eval_beta_is_given(
    engine: Engine, log: EventLog
) -> None:
    """task-scheduler §5: an eval request's ``dagger_beta`` never reaches its episodes;
    ``eval_dagger_beta`` re-injects one (-1.0: the episode saw none)."""
    engine.start_worker()
    engine.start_finalizer()
    cases = {"ev0": {"dagger_beta": 0.25}, "ev1": {"dagger_beta": 0.25, "eval_dagger_beta": 0.5}}
    for rollout_id, knobs in cases.items():
        await start_rollout(log, rollout_id, n_prompts=1, kind=RolloutKind.EVAL, knobs=knobs)
        await asyncio.wait_for(RolloutClient(log).wait_ready(rollout_id), 30)
    for rollout_id, want in (("ev0", -1.0), ("ev1", 0.5)):
        done = await events_of(log, log.names.rollout(rollout_id), SampleCompleted)
        assert done and {d.metrics["dagger_beta"] for d in done} == {want}


async def test_each_failure_becomes_a_classified_masked_dummy(
    engine: Engine, log: EventLog
) -> None:
    scripts: dict[int, dict[str, Any]] = {
        1: {"fail": {"phase": "run", "error": "conn"}},
        2: {"fail": {"phase": "init", "error": "sandbox"}},
        3: {"fail": {"phase": "eval", "error": "other"}},
        4: {"sleep_s": 60},  # past the 0.5 s episode window
        5: {"fail": {"phase": "cleanup", "error": "msg:connection reset by peer"}},
        6: {"reason": "infra_sandbox"},  # the agent reports an abort without raising
        7: {"no_logprobs": True},  # untrainable in a training rollout
        8: {"fail": {"phase": "run", "error": "timeout"}},
    }
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(
        log, "r2", n_prompts=9, script=lambda i: scripts.get(i, {}), stopping={"timeout_s": 0.5}
    )
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r2"), 30)
    assert (ready.n_completed, ready.n_aborted) == (1, 8)

    aborted = {a.sample_id: a for a in await events_of(log, log.names.rollout("r2"), SampleAborted)}
    expected = {
        1: (AbortClass.INFRA_CONN, "run", None),
        2: (AbortClass.INFRA_SANDBOX, "init", None),
        3: (AbortClass.INFRA_OTHER, "eval", "finish"),
        4: (AbortClass.AGENT_TIMEOUT, "run", None),
        5: (AbortClass.INFRA_CONN, "cleanup", "finish"),
        6: (AbortClass.INFRA_SANDBOX, "run", "infra_sandbox"),
        7: (AbortClass.INFRA_OTHER, "run", "finish"),
        8: (AbortClass.AGENT_TIMEOUT, "run", None),
    }
    for i, (cls, phase, agent_reason) in expected.items():
        a = aborted[f"r2:s{i}"]
        assert (a.abort_class, a.phase, a.agent_reason) == (cls, phase, agent_reason), i
        assert a.window_s == 0.5 and a.attempt == 1
    assert aborted["r2:s4"].elapsed_s >= 0.5  # the window elapsed during run
    assert aborted["r2:s1"].node in ("node-a", "node-b") and aborted["r2:s2"].node == ""
    assert "refused the connection" in aborted["r2:s1"].error

    samples = {s.sample_id: s for s in await RolloutClient(log).load("r2")}
    dummy = samples["r2:s3"]
    assert dummy.tokens == DUMMY_TOKENS and dummy.loss_mask == (0, 0)
    assert dummy.remove_sample and dummy.reward == 0.0 and dummy.status == "aborted"
    assert dummy.termination_reason == "infra_other" and dummy.index == 3
    assert dummy.metadata["termination_reason_agent"] == "finish"
    assert samples["r2:s0"].status == "completed"
    assert_tokens_released_once(await released_tokens(log, "r2"))


async def test_local_tokens_bound_running_samples_and_free_early(
    engine: Engine, log: EventLog
) -> None:
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(
        log, "r3", n_prompts=8, batch_size=8, tokens_per_batch=2,
        script=lambda i: {"sleep_s": 0.02},
    )
    await asyncio.wait_for(RolloutClient(log).wait_ready("r3"), 30)
    assert PEAK["r3"] == 2  # two tokens, although the evaluator allows four at once
    assert_tokens_released_once(await released_tokens(log, "r3"))
    releases = [
        ev for ev in await events_of(log, log.names.pool, TokenReleased) if ev.rollout_id == "r3"
    ]
    assert {ev.reason for ev in releases} == {"sample_done"}


async def test_tokens_leave_as_soon_as_no_sample_needs_them(
    engine: Engine, log: EventLog
) -> None:
    # Three samples hold three tokens; two end at once while the third never does: their
    # two tokens are released while the batch is still running.
    stop = asyncio.Event()
    engine.start_worker("wA", stop=stop, grace_s=0.0)
    await start_rollout(
        log, "r3c", n_prompts=3, script=lambda i: {"hang_attempts": [1]} if i == 2 else {}
    )
    position = "0-0"
    released: list[str] = []
    while len(released) < 2:
        envs, position = await log.read_after(log.names.pool, position, block_ms=5000)
        for env in envs:
            if isinstance(env.event, TokenReleased) and env.event.rollout_id == "r3c":
                released.extend(env.event.token_ids or [])
    state = await wait_state(log, "r3c", lambda s: s.n_terminal == 2, timeout=5)
    assert state.samples["r3c:s2"].done is False  # still running
    assert len(set(released)) == 2
    stop.set()


async def test_surplus_tokens_are_released_before_running(engine: Engine, log: EventLog) -> None:
    # The scripted evaluator runs 4 samples at once; a batch of 4 holding 4 tokens with
    # only 2 samples left to run (recovery) must not sit on the other 2.
    engine.start_worker()
    engine.start_finalizer()
    await start_rollout(log, "r3b", n_prompts=6, batch_size=6, tokens_per_batch=6)
    await asyncio.wait_for(RolloutClient(log).wait_ready("r3b"), 30)
    assert_tokens_released_once(await released_tokens(log, "r3b"))
    releases = [
        ev for ev in await events_of(log, log.names.pool, TokenReleased) if ev.rollout_id == "r3b"
    ]
    assert releases[0].reason == "surplus" and len(releases[0].token_ids or []) == 2


class RecordingProvider:
    """A sandbox provider that only records reaps (the scripted agent opens none)."""

    def __init__(self) -> None:
        self.reaped: list[dict[str, str]] = []

    def create(self, *, labels: Mapping[str, str], limits: Any = None) -> Any:
        raise AssertionError("not used")

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        self.reaped.append(dict(label_selector))
        return 0


async def test_a_handed_back_batch_is_finished_by_another_worker(
    engine: Engine, log: EventLog
) -> None:
    # Worker A hangs on sample 1; stopped with no grace it leaves the batch pending.
    # Worker B claims it after the idle window, reaps A's sandboxes for the batch, re-runs
    # only sample 1 (attempt 2) with the batch's tokens, and releases every token once.
    stop_a = asyncio.Event()
    engine.start_worker("wA", stop=stop_a, grace_s=0.0)
    engine.start_finalizer()
    await start_rollout(
        log, "r4", n_prompts=4, script=lambda i: {"hang_attempts": [1]} if i == 1 else {}
    )

    def only_hung_left(state: RolloutState) -> bool:
        hung = state.samples.get("r4:s1")
        return state.n_terminal == 3 and hung is not None and hung.started

    await wait_state(log, "r4", only_hung_left)
    stop_a.set()
    provider = RecordingProvider()
    engine.start_worker("wB", sandboxes=provider)
    await asyncio.wait_for(RolloutClient(log).wait_ready("r4"), 30)

    stream = log.names.rollout("r4")
    terminals = defaultdict(list)
    for ev in await events_of(log, stream, SampleCompleted):
        terminals[ev.sample_id].append(ev.attempt)
    assert dict(terminals) == {"r4:s0": [1], "r4:s1": [2], "r4:s2": [1], "r4:s3": [1]}
    assert provider.reaped == [
        {"rollout.worker": "wA", "rollout.rollout": "r4", "rollout.batch": "r4:b0"}
    ]
    started_b = [s for s in await events_of(log, stream, SampleStarted) if s.worker == "wB"]
    assert [(s.sample_id, s.attempt) for s in started_b] == [("r4:s1", 2)]
    assert_tokens_released_once(await released_tokens(log, "r4"))
    await engine.close()
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0


def start_worker_allowing_one_delivery(
    engine: Engine, worker_id: str, **overrides: Any
) -> EvaluatorWorker:
    """A worker whose log dead-letters any entry delivered more than once."""
    worker = engine.worker(worker_id, **overrides)
    worker.log.max_deliveries = 1
    engine.tasks.append(asyncio.create_task(worker.run(engine.stop)))
    return worker


async def leave_a_hung_batch(
    engine: Engine,
    log: EventLog,
    rollout_id: str,
    *,
    hang_attempts: tuple[int, ...] = (1, 2),
    dies: bool = True,
) -> None:
    """Worker wA runs a 3-sample batch whose first sample hangs (on ``hang_attempts``) and
    ends once the other two are done. With ``dies`` it leaves the batch pending, delivered
    once and claimable after the idle window; otherwise it stops with no grace and hands
    the batch back (claimable at once, uncharged)."""
    stop_a = asyncio.Event()
    worker_a = engine.start_worker("wA", stop=stop_a, grace_s=0.0)

    async def die_without_handing_back(deliveries: Any) -> None:
        for d in deliveries:
            worker_a.consumer.release(d)

    if dies:
        worker_a.consumer.hand_back = die_without_handing_back  # type: ignore[method-assign]
    engine.start_finalizer()
    await start_rollout(
        log, rollout_id, n_prompts=3,
        script=lambda i: {"hang_attempts": list(hang_attempts)} if i == 0 else {},
    )
    await wait_state(log, rollout_id, lambda s: s.n_terminal == 2)
    stop_a.set()
    await asyncio.wait_for(engine.tasks[0], 30)


async def test_a_stopped_worker_hands_its_batch_back_uncharged_and_at_once(
    engine: Engine, log: EventLog
) -> None:
    # wA stops with no grace: the hung batch is handed back. wB allows one delivery and
    # has a 60 s idle window, yet takes it over at once and finishes it: the hand-back is
    # neither a delivery nor an idle wait.
    await leave_a_hung_batch(engine, log, "r14", hang_attempts=(1,), dies=False)
    worker_b = start_worker_allowing_one_delivery(engine, "wB", claim_idle_ms=60_000)
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r14"), 20)
    assert (ready.n_completed, ready.n_aborted) == (3, 0)
    assert await log.read_all(log.names.dead) == []
    await engine.close()
    assert worker_b.batches_done == 1
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0


async def test_a_dead_lettered_batch_aborts_its_open_samples(
    engine: Engine, log: EventLog
) -> None:
    await leave_a_hung_batch(engine, log, "r5")
    # B's log allows a single delivery: the claim finds the entry delivered twice.
    start_worker_allowing_one_delivery(engine, "wB")
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r5"), 30)
    assert (ready.n_completed, ready.n_aborted) == (2, 1)
    (aborted,) = await events_of(log, log.names.rollout("r5"), SampleAborted)
    assert aborted.sample_id == "r5:s0" and aborted.abort_class is AbortClass.INFRA_OTHER
    assert aborted.phase == "delivery" and "dead-lettered" in aborted.error
    assert_tokens_released_once(await released_tokens(log, "r5"))
    dead = await log.read_all(log.names.dead)
    assert len(dead) == 1


async def test_a_claimed_batch_is_leased_before_it_reruns_and_its_releases_carry_the_lease(
    engine: Engine, log: EventLog
) -> None:
    await leave_a_hung_batch(engine, log, "r21", hang_attempts=(1,))
    engine.start_worker("wB")  # claims it after the idle window: delivery 2
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r21"), 30)
    assert (ready.n_completed, ready.n_aborted) == (3, 0)
    await released_tokens(log, "r21")
    pool = await log.read_all(log.names.pool)
    (lease,) = [e for e in pool if isinstance(e.event, BatchLeased)]
    assert (lease.event.lease, lease.event.worker) == (2, "wB")  # type: ignore[attr-defined]
    releases = [e for e in pool if isinstance(e.event, TokenReleased)]
    # wA's releases (for the two samples it finished) ran under lease 1, wB's under 2.
    at = parse_id(lease.id)
    assert {e.event.lease for e in releases if parse_id(e.id) < at} == {1}  # type: ignore[attr-defined]
    assert {e.event.lease for e in releases if parse_id(e.id) > at} == {2}  # type: ignore[attr-defined]
    starts = await events_of(log, log.names.rollout("r21"), SampleStarted)
    assert sorted((s.attempt, s.worker) for s in starts if s.sample_id == "r21:s0") == [
        (1, "wA"), (2, "wB"),
    ]
    await engine.close()


class _Died(Exception):
    """Stands for a worker process dying."""


async def test_a_worker_dying_before_its_dead_letter_abort_leaves_it_to_the_next(
    engine: Engine, log: EventLog
) -> None:
    await leave_a_hung_batch(engine, log, "r9")
    # B claims the batch, finds it over the delivery limit, dead-letters it, and dies
    # before the abort is recorded.
    worker_b = engine.worker("wB")
    worker_b.log.max_deliveries = 1

    async def die(entry: Any) -> None:
        raise _Died(entry.id)

    worker_b._abort_dead = die  # type: ignore[method-assign]
    with pytest.raises(_Died):
        await asyncio.wait_for(worker_b.run(engine.stop), 30)
    work = log.names.work("scripted")
    assert await log.pending_count(work, "evaluators") == 1
    # C claims it after the idle window, finds it dead again and records the abort; the
    # dead-letter stream keeps the one letter B wrote.
    start_worker_allowing_one_delivery(engine, "wC")
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r9"), 30)
    assert (ready.n_completed, ready.n_aborted) == (2, 1)
    (aborted,) = await events_of(log, log.names.rollout("r9"), SampleAborted)
    assert aborted.sample_id == "r9:s0" and aborted.phase == "delivery"
    assert_tokens_released_once(await released_tokens(log, "r9"))
    letters = [e.event for e in await log.read_all(log.names.dead)]
    assert len(letters) == 1 and letters[0].error.startswith("delivered 2 times")  # type: ignore[attr-defined]
    await engine.close()
    assert await log.pending_count(work, "evaluators") == 0


async def test_a_worker_restarted_under_its_name_past_the_limit_aborts_the_batch(
    engine: Engine, log: EventLog
) -> None:
    await leave_a_hung_batch(engine, log, "r10")
    # The same worker name comes back: re-reading its pending batch is delivery 2.
    start_worker_allowing_one_delivery(engine, "wA")
    ready = await asyncio.wait_for(RolloutClient(log).wait_ready("r10"), 30)
    assert (ready.n_completed, ready.n_aborted) == (2, 1)
    (aborted,) = await events_of(log, log.names.rollout("r10"), SampleAborted)
    assert aborted.sample_id == "r10:s0" and "delivered 2 times" in aborted.error
    assert_tokens_released_once(await released_tokens(log, "r10"))
    await engine.close()
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0


async def test_stop_with_grace_finishes_running_batches(engine: Engine, log: EventLog) -> None:
    stop = asyncio.Event()
    worker = engine.start_worker("wA", stop=stop, grace_s=30.0)
    await start_rollout(log, "r6", n_prompts=4, script=lambda i: {"sleep_s": 0.2})
    await wait_state(log, "r6", lambda s: any(x.started for x in s.samples.values()))
    stop.set()
    await asyncio.wait_for(engine.tasks[-1], 30)
    state = await wait_state(log, "r6", _all_done, timeout=1)
    assert state.n_terminal == 4
    assert worker.batches_done == 1 and worker.batches_handed_back == 0
    assert await log.pending_count(log.names.work("scripted"), "evaluators") == 0


def test_the_worker_progress_printer_counts_from_batch_reports() -> None:
    import io

    from engine.actors.evaluator_worker import BatchReport
    from workers.evaluator import Progress

    out = io.StringIO()
    progress = Progress("w1", out=out)
    for batch, (done, aborted, again) in enumerate([(5, 1, False), (2, 0, True)]):
        progress.on_batch_done(
            BatchReport(rollout_id="r1", batch_id=f"b{batch}", evaluator_id="math",
                        ran=done + aborted, completed=done, aborted=aborted, redelivered=again)
        )  # fmt: skip
    assert (progress.completed, progress.aborted) == (7, 1)
    assert out.getvalue().splitlines() == [
        "[w1] batch b0: 5 completed, 1 aborted | total 5 completed, 1 aborted",
        "[w1] batch b1 (recovered): 2 completed, 0 aborted | total 7 completed, 1 aborted",
    ]


def test_an_episode_context_gets_its_token_node_and_keeps_every_other_field() -> None:
    from pathlib import Path

    from engine.actors.attempt_context import with_node
    from engine.agents.base import EpisodeContext
    from engine.domain import SamplingParams, StoppingCriteria

    ctx = EpisodeContext(
        rollout_id="r1", sample_id="s1", attempt=2, stopping=StoppingCriteria(),
        sampling_params=SamplingParams(), tmp_dir=Path("/tmp/x"), seed=7, dagger_beta=0.5,
    )  # fmt: skip
    moved = with_node(ctx, "node-a")
    assert moved.node == "node-a" and ctx.node is None
    assert moved == EpisodeContext(**{**ctx.__dict__, "node": "node-a"})


async def test_a_worker_decodes_only_the_tasks_its_batches_need(
    log: EventLog, specs: Mapping[str, Any]
) -> None:
    from engine.actors.evaluator_worker import WorkerConfig
    from engine.events import RolloutRequested, TaskFetched, TaskJoined
    from engine.events.redis_log import FIELD
    from engine.projections.rollout import RolloutProjection
    from engine.runtime.readback import read_tasks
    from engine.runtime.rebuild import rebuild

    def task(i: int) -> TaskFetched:
        return TaskFetched(rollout_id="r1", sample_id=f"s{i}", index=i, group_index=i // 2,
                           prompt=f"q{i // 2}", dataset="math", task_type="math")  # fmt: skip

    stream = log.names.rollout("r1")
    request = RolloutRequested(rollout_id="r1", iteration=1, n_prompts=3, n_samples_per_prompt=2)
    events: list[Any] = [request]
    for i in range(6):
        joined = TaskJoined.of(task(i), task(i - 1)) if i % 2 else None
        events.append(joined or task(i))
    await log.append_many([(stream, ev) for ev in events[:4]])
    await write_raw(log, stream, {FIELD: b"\xc1 not msgpack"})  # skipped, not fatal
    await log.append_many([(stream, ev) for ev in events[4:]])

    evaluator = next(iter(specs))
    folded = (await rebuild(log, stream, RolloutProjection())).state
    assert folded.request is not None
    whole = await read_tasks(log, stream, folded, folded.samples)
    for window in (2048, 0):  # entries kept as read, or every one re-read from the index
        config = WorkerConfig(worker_id="w1", evaluator_ids=(evaluator,), task_window=window)
        worker = EvaluatorWorker(log, specs, config)
        request, tasks = await worker.tasks.batch_tasks("r1", ["s3"])
        assert request == folded.request
        assert list(tasks) == ["s3"]  # joined on s2, which is decoded but not kept
        cached = worker.tasks.cache["r1"]
        assert sorted(cached.recent) == (["s0", "s1", "s4", "s5"] if window else [])
        request, more = await worker.tasks.batch_tasks("r1", ["s1", "s4", "missing", "s2"])
        assert list(more) == ["s1", "s4", "s2"]  # no entry for "missing": left out
        tasks.update(more)
        for sid, ev in tasks.items():
            assert ev == whole[sid]  # what the rollout fold makes of the stream


class _ControlAway:
    """The log, except that blocking reads of ``rl:control`` fail as an outage: the work
    streams still answer, only the worker's follower of the control stream loses Redis."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self.failed = 0

    async def read_after(self, stream: str, *args: Any, **kwargs: Any) -> Any:
        if stream == self._log.names.control:
            self.failed += 1
            raise LogUnavailable("redis at 127.0.0.1:1 is unreachable (test)")
        return await self._log.read_after(stream, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._log, name)


async def test_a_control_outage_past_the_limit_ends_the_worker_with_outage_exceeded(
    log: EventLog, specs: Mapping[str, EvaluatorBinding]
) -> None:
    """The worker follows rl:control once; when that follower cannot reach Redis for longer
    than the outage limit, the worker ends with ``OutageExceeded`` (the process exits)
    instead of retrying forever while its batches read a stale control state."""
    away = _ControlAway(log)
    evaluator = next(iter(specs))
    config = WorkerConfig(worker_id="w1", evaluator_ids=(evaluator,), block_ms=50,
                          outage_limit_s=0.3)
    worker = EvaluatorWorker(away, specs, config)
    stop = asyncio.Event()
    with pytest.raises(OutageExceeded, match="outage limit of 0.3 s"):
        await asyncio.wait_for(worker.run(stop), 30)
    assert away.failed >= 2 and not stop.is_set()
