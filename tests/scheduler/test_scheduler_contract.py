"""The scheduler through the log, on fakeredis and on a real redis-server (``redis_factory``).

Every test plays the evaluators with ``FakeEvaluators`` (it releases the tokens of admitted
batches) and asserts on the streams: what was planned, what was admitted, and that the
pool never over-allocates at any prefix of ``rl:pool``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.actors.planning import Planner
from engine.actors.scheduler import SCHEDULER_GROUP, Scheduler
from engine.config.layout import ClusterLayout
from engine.config.rollout import load_rollout_config
from engine.data_source import MultiDataSource
from engine.domain import EvaluatorProfile, sample_id_for
from engine.errors import LogUnavailable
from engine.events import (
    BatchAdmitted,
    BatchSealed,
    DataCursorAdvanced,
    Envelope,
    EventLog,
    PolicyVersionPublished,
    RolloutFailed,
    RolloutPlanned,
    RolloutRequested,
    TaskFetched,
    TaskJoined,
    TokenAcquired,
)
from engine.projections.data_cursor import DataState
from tests.conftest import ClientFactory
from tests.scheduler.helpers import (
    RANDOM_EVALUATORS,
    FakeEvaluators,
    all_admitted,
    check_every_prefix,
    fresh_client_log,
    layout,
    load_specs,
    make_scheduler,
    request,
    running,
    write_config,
)

TIMEOUT = 60

RANDOM_LAYOUT = {
    "n1": {"gpus": [0, 1, 2, 3], "cpu": 12, "memory_gb": 24},
    "n2": {"gpus": [0, 1], "cpu": 8, "memory_gb": 16},
    "n3": {"gpus": [], "cpu": 6, "memory_gb": 12},
}
SMALL_LAYOUT = {"n1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}}


async def events_of(log: EventLog, stream: str) -> list[Envelope]:
    return await log.read_all(stream)


def of_type(envs: list[Envelope], kind: type) -> list:  # type: ignore[type-arg]
    """The events of ``kind``; for ``TaskFetched``, every task as readers see it: a
    ``TaskJoined`` (a group's sample after its first) as the ``TaskFetched`` it stands for."""
    if kind is not TaskFetched:
        return [e.event for e in envs if isinstance(e.event, kind)]
    out: list[TaskFetched] = []
    firsts: dict[str, TaskFetched] = {}
    for env in envs:
        ev = env.event
        if isinstance(ev, TaskJoined):
            ev = ev.task(firsts[ev.same_as])
        if isinstance(ev, TaskFetched):
            firsts.setdefault(ev.sample_id, ev)
            out.append(ev)
    return out


async def assert_exactly_once(log: EventLog, rollout_ids: list[str], evaluators: list[str]) -> None:
    """Each sample fetched once, each batch acquired and admitted once, the pool full again,
    no prefix over-allocated, every request acked."""
    pool_events = await events_of(log, log.names.pool)
    final = check_every_prefix(pool_events)
    assert final.is_full_capacity()
    acquired = Counter((a.rollout_id, a.batch_id) for a in of_type(pool_events, TokenAcquired))
    admitted: Counter[tuple[str, str]] = Counter()
    for evaluator_id in evaluators:
        for ev in of_type(await events_of(log, log.names.work(evaluator_id)), BatchAdmitted):
            admitted[(ev.rollout_id, ev.batch_id)] += 1
            assert ev.evaluator_id == evaluator_id
    for rid in rollout_ids:
        envs = await events_of(log, log.names.rollout(rid))
        fetched = Counter(t.sample_id for t in of_type(envs, TaskFetched))
        assert fetched and set(fetched.values()) == {1}
        (plan,) = of_type(envs, RolloutPlanned)
        batches = of_type(envs, BatchSealed)
        assert [b.batch_id for b in batches] == plan.batch_ids
        assert sorted(s for b in batches for s in b.sample_ids) == sorted(fetched)
        for b in batches:
            assert acquired[(rid, b.batch_id)] == 1
            assert admitted[(rid, b.batch_id)] == 1
    assert sum(acquired.values()) == sum(admitted.values())
    assert await log.pending_count(log.names.control, SCHEDULER_GROUP) == 0


# ---------------------------------------------------------------- concurrency


@pytest.mark.parametrize("resource_seed", [2, 9])
async def test_concurrent_schedulers_never_over_allocate(
    redis_factory: ClientFactory, tmp_path: Path, resource_seed: int
) -> None:
    config = write_config(tmp_path, {"da": ("alpha", 5), "db": ("beta", 4), "dc": ("gamma", 6)})
    specs = load_specs(RANDOM_EVALUATORS, resource_seed=resource_seed)
    cluster = layout(RANDOM_LAYOUT)
    schedulers = [
        make_scheduler(fresh_client_log(redis_factory, f"s{i}"), config, specs, cluster,
                       scheduler_id=f"s{i}")
        for i in range(3)
    ]
    log = fresh_client_log(redis_factory, "trainer")
    rollout_ids = [f"r{i}" for i in range(5)]
    for i, rid in enumerate(rollout_ids):
        await log.append(log.names.control, request(rid, n_prompts=4 + i, seed=3))
    evaluators = FakeEvaluators(log, list(specs), hold=3, seed=resource_seed)
    async with running(schedulers):
        await asyncio.wait_for(evaluators.run(all_admitted(log, rollout_ids)), TIMEOUT)
        # The last acks follow the last admissions; wait on the group, not on a clock.
        while await log.pending_count(log.names.control, SCHEDULER_GROUP):
            await log.tail({log.names.pool: "$"}, block_ms=50)
    await assert_exactly_once(log, rollout_ids, list(specs))
    # The training cursor advanced once per rollout, in one sequence.
    advanced = of_type(await events_of(log, log.names.data), DataCursorAdvanced)
    assert sorted(a.rollout_id for a in advanced) == rollout_ids
    for before, after in zip(advanced, advanced[1:], strict=False):
        assert after.previous == before.cursor


async def test_two_schedulers_handling_the_same_request_plan_and_admit_once(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    """A claim race: the same control entry is worked on by two schedulers at once."""
    config = write_config(tmp_path, {"gsm": ("math", 12)})
    specs = load_specs()
    cluster = layout(SMALL_LAYOUT)
    a, b = (
        make_scheduler(fresh_client_log(redis_factory, name), config, specs, cluster,
                       scheduler_id=name, plan_chunk=4)
        for name in ("a", "b")
    )
    log = fresh_client_log(redis_factory, "trainer")
    req = request("r1", n_prompts=9)
    entry_id = await log.append(log.names.control, req)
    env = Envelope(log.names.control, entry_id, req)
    evaluators = FakeEvaluators(log, ["math"], hold=1)
    for s in (a, b):
        await s.start()
    watchers = [asyncio.create_task(s.gate.pool.run()) for s in (a, b)]
    try:
        await asyncio.wait_for(
            asyncio.gather(
                a.handle(env, req),
                b.handle(env, req),
                evaluators.run(all_admitted(log, ["r1"])),
            ),
            TIMEOUT,
        )
    finally:
        for s in (a, b):
            s.gate.close()
        await asyncio.gather(*watchers)
    (advanced,) = of_type(await events_of(log, log.names.data), DataCursorAdvanced)
    assert advanced.rollout_id == "r1"
    await log.ack(log.names.control, SCHEDULER_GROUP, entry_id)
    await assert_exactly_once(log, ["r1"], ["math"])


# ---------------------------------------------------------------- what is planned


async def test_plan_order_batching_and_data_cursor(redis_factory: ClientFactory,
                                                   tmp_path: Path) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 5), "py": ("code", 4)})
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    scheduler = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs,
                               layout(SMALL_LAYOUT))
    first = await log.append(log.names.control,
                             request("r1", n_prompts=4, n_samples_per_prompt=2, seed=11))
    await log.append(log.names.control, request("r2", n_prompts=3, seed=99))
    evaluators = FakeEvaluators(log, list(specs), hold=0)
    async with running([scheduler]):
        await asyncio.wait_for(evaluators.run(all_admitted(log, ["r1", "r2"])), TIMEOUT)
    await assert_exactly_once(log, ["r1", "r2"], list(specs))

    envs = await events_of(log, log.names.rollout("r1"))
    assert isinstance(envs[0].event, RolloutRequested)
    assert envs[0].event.causation == f"{log.names.control}@{first}"
    kinds = [type(e.event).__name__ for e in envs]
    n_batches = kinds.count("BatchSealed")
    # 4 groups of 2: each group's task once, its second sample joined to it.
    assert kinds == ["RolloutRequested"] + ["TaskFetched", "TaskJoined"] * 4 + [
        "BatchSealed"
    ] * n_batches + ["RolloutPlanned"]
    tasks = of_type(envs, TaskFetched)
    assert [t.sample_id for t in tasks] == [sample_id_for("r1", i) for i in range(8)]
    assert [t.group_index for t in tasks] == [0, 0, 1, 1, 2, 2, 3, 3]

    # Both rollouts together served exactly what one fetch from the first cursor serves
    # (the first rollout's seed seeds the order; the second continues the cursor).
    advanced = of_type(await events_of(log, log.names.data), DataCursorAdvanced)
    order = [a.rollout_id for a in advanced]
    assert sorted(order) == ["r1", "r2"]
    source = MultiDataSource(load_rollout_config(config).datasets)
    seed = 11 if order[0] == "r1" else 99
    records, _ = source.fetch(source.start(seed), 4 + 3)
    served: list[tuple[str, int]] = []
    for rid in order:
        for t in of_type(await events_of(log, log.names.rollout(rid)), TaskFetched):
            key = (t.dataset, t.source_line)
            if not served or served[-1] != key:  # groups repeat their prompt
                served.append(key)
    assert served == [(r.dataset.name, r.line) for r in records]

    # fifo batching: by task type in encounter order, sealed at batch_size (math 3, code 2).
    for rid in order:
        envs = await events_of(log, log.names.rollout(rid))
        tasks = of_type(envs, TaskFetched)
        expected: list[list[str]] = []
        open_batch: dict[str, list[str]] = {}
        for t in tasks:
            group = open_batch.get(t.task_type)
            if group is None:
                group = open_batch[t.task_type] = []
                expected.append(group)
            group.append(t.sample_id)
            if len(group) == {"math": 3, "code": 2}[t.task_type]:
                del open_batch[t.task_type]
        batches = of_type(envs, BatchSealed)
        assert [b.sample_ids for b in batches] == expected
        assert [b.seq for b in batches] == list(range(len(batches)))
        # Admission follows seq order within each evaluator's work stream.
        for evaluator_id in specs:
            seqs = {b.batch_id: b.seq for b in batches}
            admitted = [
                seqs[a.batch_id]
                for a in of_type(await events_of(log, log.names.work(evaluator_id)), BatchAdmitted)
                if a.rollout_id == rid
            ]
            assert admitted == sorted(admitted)


async def test_eval_interleaves_round_robin_and_leaves_the_train_cursor(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        {"gsm": ("math", 6)},
        {"aime": ("math", 4), "humaneval": ("code", 2)},
        eval_extra={"aime": {"n_samples_per_eval_prompt": 2}},
    )
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    scheduler = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs, None)
    await log.append(log.names.control, request("ev", kind="eval", seed=5))
    evaluators = FakeEvaluators(log, list(specs), hold=0)
    async with running([scheduler]):
        await asyncio.wait_for(evaluators.run(all_admitted(log, ["ev"])), TIMEOUT)
        await log.append(log.names.control, request("tr", n_prompts=2, seed=5))
        await asyncio.wait_for(evaluators.run(all_admitted(log, ["ev", "tr"])), TIMEOUT)
    tasks = of_type(await events_of(log, log.names.rollout("ev")), TaskFetched)
    # aime has 8 samples (4 prompts x 2), humaneval 2: A B A B, then the rest of A.
    assert [t.dataset for t in tasks] == ["aime", "humaneval"] * 2 + ["aime"] * 6
    assert [t.metadata["row"] for t in tasks if t.dataset == "aime"] == [0, 0, 1, 1, 2, 2, 3, 3]
    advanced = {a.rollout_id: a for a in of_type(await events_of(log, log.names.data),
                                                  DataCursorAdvanced)}
    assert advanced["ev"].kind == "eval" and advanced["ev"].cursor == {}
    # The train rollout after the eval starts at the very beginning of the training data.
    source = MultiDataSource(load_rollout_config(config).datasets)
    assert advanced["tr"].previous == source.start(5).model_dump(mode="json")
    # Ungated: admitted at once, node-less tokens, still recorded once on the pool.
    for a in of_type(await events_of(log, log.names.pool), TokenAcquired):
        assert all(g.node == "" for g in a.tokens)
    await assert_exactly_once(log, ["ev", "tr"], list(specs))


async def test_generation_settings_cascade_and_knobs(redis_factory: ClientFactory,
                                                     tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        {"gsm": ("math", 3), "py": ("code", 3)},
        train_extra={"gsm": {"max_new_tokens": 64, "sampling_params": {"temperature": 0.2}}},
    )
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    scheduler = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs, None)
    await log.append(
        log.names.control,
        request(
            "r1",
            n_prompts=6,
            sampling_params={"temperature": 1.0, "top_k": 5},
            stopping={"max_turns": 99, "timeout_s": 30.0},
            knobs={"dagger_beta": 0.5, "t_max": 7},
        ),
    )
    async with running([scheduler]):
        await asyncio.wait_for(
            FakeEvaluators(log, list(specs), hold=0).run(all_admitted(log, ["r1"])), TIMEOUT
        )
    stream = await events_of(log, log.names.rollout("r1"))
    tasks = {t.dataset: t for t in of_type(stream, TaskFetched)}
    math, code = tasks["gsm"], tasks["py"]
    # request (coarsest) < evaluator profile default < dataset (finest)
    assert math.sampling_params.as_request() == {"temperature": 0.2, "top_p": 0.9, "top_k": 5}
    assert math.stopping.model_dump(exclude_none=True) == {
        "max_turns": 4, "max_context_len": 2048, "max_new_tokens": 64, "timeout_s": 30.0}
    assert code.sampling_params.as_request() == {"temperature": 1.0, "top_k": 5}
    assert code.stopping.model_dump(exclude_none=True) == {"max_turns": 10, "timeout_s": 30.0}
    # The knobs travel once, in the request copy that opens the rollout stream.
    assert of_type(stream, RolloutRequested)[0].knobs == {"dagger_beta": 0.5, "t_max": 7}
    assert math.dataset == "gsm" and math.stopping.max_new_tokens == 64
    assert math.label == f"gsm-{math.metadata['row']}" and math.task_type == "math"


# ---------------------------------------------------------------- chunking and resume


async def test_long_plans_are_chunked_and_an_interrupted_plan_is_completed(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 30)})
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    req = request("r1", n_prompts=25, seed=1)
    entry = await log.append(log.names.control, req)
    # A scheduler that died after the first chunk: cursor + request copy + 4 tasks.
    plan = Planner(load_rollout_config(config), specs).plan(req, DataState())
    head = plan.rollout_events(0, 5)
    await log.append_if_last(log.names.data, plan.cursor, "0-0",
                             causation=f"{log.names.control}@{entry}")
    await log.append_if_last(log.names.rollout("r1"), head, "0-0",
                             causation=f"{log.names.control}@{entry}")
    scheduler = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs,
                               layout(SMALL_LAYOUT), plan_chunk=7)
    await log.append(log.names.control, request("r2", n_prompts=3))
    async with running([scheduler]):
        await asyncio.wait_for(
            FakeEvaluators(log, ["math"], hold=1).run(all_admitted(log, ["r1", "r2"])), TIMEOUT
        )
    await assert_exactly_once(log, ["r1", "r2"], ["math"])
    envs = await events_of(log, log.names.rollout("r1"))
    assert [e.event for e in envs] == [
        ev.model_copy(update={"producer": envs[i].event.producer,
                              "causation": envs[i].event.causation})
        for i, ev in enumerate(plan.rollout_events())
    ]
    assert len(of_type(await events_of(log, log.names.data), DataCursorAdvanced)) == 2


@dataclass
class StoppedMidRollout:
    """Scheduler s0 admitted the first of r1's batches (one fits the pool) and stopped."""

    config: Path
    specs: Mapping[str, EvaluatorProfile]
    cluster: ClusterLayout
    log: EventLog
    evaluators: FakeEvaluators


async def stop_mid_rollout(redis_factory: ClientFactory, tmp_path: Path) -> StoppedMidRollout:
    config = write_config(tmp_path, {"gsm": ("math", 12)})
    specs = load_specs()
    cluster = layout({"n1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}})  # one math batch
    log = fresh_client_log(redis_factory, "trainer")
    await log.append(log.names.control, request("r1", n_prompts=12))
    evaluators = FakeEvaluators(log, ["math"], hold=0, released=False)

    async def first_admitted(admitted: list[Envelope]) -> bool:
        return len(admitted) >= 1

    first = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs, cluster)
    async with running([first]):
        await asyncio.wait_for(evaluators.run(first_admitted), TIMEOUT)
    return StoppedMidRollout(config, specs, cluster, log, evaluators)


async def finish_with(
    stopped: StoppedMidRollout, scheduler: Scheduler, timeout: float = TIMEOUT
) -> None:
    """Let the evaluators release tokens, run ``scheduler`` until r1 is fully admitted and
    acked, and check every batch was admitted exactly once."""
    log = stopped.log
    stopped.evaluators.released = True
    async with running([scheduler]):
        await asyncio.wait_for(stopped.evaluators.run(all_admitted(log, ["r1"])), timeout)
        while await log.pending_count(log.names.control, SCHEDULER_GROUP):
            await log.tail({log.names.pool: "$"}, block_ms=50)
    await assert_exactly_once(log, ["r1"], ["math"])


async def test_a_restarted_scheduler_resumes_without_duplicates(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    stopped = await stop_mid_rollout(redis_factory, tmp_path)
    log = stopped.log
    # Stopped mid-rollout: the request is still pending for s0, one batch holds tokens.
    assert await log.pending_count(log.names.control, SCHEDULER_GROUP) == 1
    again = make_scheduler(fresh_client_log(redis_factory, "s0-again"), stopped.config,
                           stopped.specs, stopped.cluster, scheduler_id="s0")
    await finish_with(stopped, again)


async def test_a_stopped_scheduler_hands_its_rollout_to_a_peer_at_once(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    # s0 stops mid-rollout; s1, whose idle window is a minute, takes the request over at
    # once (the hand-back made it claimable) and finishes the admissions exactly once.
    stopped = await stop_mid_rollout(redis_factory, tmp_path)
    log = stopped.log
    redis: Any = log.redis
    (entry,) = await redis.xpending_range(log.names.control, SCHEDULER_GROUP, "-", "+", 10)
    assert entry["times_delivered"] == 0  # handed back: the stop is not a delivery
    peer = make_scheduler(fresh_client_log(redis_factory, "s1"), stopped.config, stopped.specs,
                          stopped.cluster, scheduler_id="s1", claim_idle_ms=60_000)
    await finish_with(stopped, peer, timeout=20)


async def test_a_request_schedulers_keep_dying_on_fails_its_rollout(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    # A scheduler took the request and died (delivery 1). s1 allows one delivery: its
    # claim dead-letters the request. Its first attempt to record RolloutFailed cannot
    # reach Redis, so the request stays pending; the next claim fails the rollout, and
    # only then is the request acked.
    config = write_config(tmp_path, {"gsm": ("math", 12)})
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    await log.ensure_group(log.names.control, SCHEDULER_GROUP)
    await log.append(log.names.control, request("r1", n_prompts=2))
    await log.read_group(SCHEDULER_GROUP, "gone", [log.names.control], block_ms=50)
    s1_log = fresh_client_log(redis_factory, "s1")
    s1_log.max_deliveries = 1
    s1 = make_scheduler(s1_log, config, specs, None, scheduler_id="s1", claim_idle_ms=300)
    real_give_up = s1._give_up
    attempts = 0

    async def flaky_give_up(dead: Any) -> None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise LogUnavailable("redis unavailable during XADD: refused")
        await real_give_up(dead)

    s1._give_up = flaky_give_up  # type: ignore[method-assign]
    async with running([s1]):
        while await log.pending_count(log.names.control, SCHEDULER_GROUP):
            await log.tail({log.names.control: "$"}, block_ms=100)
    assert attempts == 2
    failed = of_type(await events_of(log, log.names.rollout("r1")), RolloutFailed)
    assert len(failed) == 1 and "schedulers gave up on the request" in failed[0].reason
    assert "delivered 3 times" in failed[0].reason
    assert of_type(await events_of(log, log.names.rollout("r1")), RolloutPlanned) == []


# ---------------------------------------------------------------- refusals


async def test_bad_requests_fail_the_rollout_and_other_events_are_acked(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    config = write_config(tmp_path, {"gsm": ("math", 3)})
    specs = load_specs()
    log = fresh_client_log(redis_factory, "trainer")
    scheduler = make_scheduler(fresh_client_log(redis_factory, "s0"), config, specs, None)
    await log.append(log.names.control, PolicyVersionPublished(version=3))
    await log.append(log.names.control, request("bad-ds", datasets=["nope"]))
    await log.append(log.names.control, request("bad-sp", sampling_params={"temperature": "hot"}))
    await log.append(log.names.control, request("bad-eval", kind="eval"))
    async with running([scheduler]):
        failures: dict[str, str] = {}
        position = "0-0"
        while len(failures) < 3:
            for env in await log.tail({log.names.control: position}, block_ms=200):
                position = env.id
                if isinstance(env.event, RolloutFailed):
                    failures[env.event.rollout_id] = env.event.reason
        while await log.pending_count(log.names.control, SCHEDULER_GROUP):
            await log.tail({log.names.pool: "$"}, block_ms=50)
    assert "requested datasets ['nope'] are not training datasets" in failures["bad-ds"]
    assert "sampling_params" in failures["bad-sp"] and "temperature" in failures["bad-sp"]
    assert "defines no eval datasets" in failures["bad-eval"]
    for rid, reason in failures.items():
        (failed,) = of_type(await events_of(log, log.names.rollout(rid)), RolloutFailed)
        assert failed.reason == reason
    assert await log.stream_length(log.names.data) == 0


async def test_a_live_scheduler_keeps_its_long_rollout(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    """Heartbeats keep a request that waits for capacity from being claimed by a peer."""
    config = write_config(tmp_path, {"gsm": ("math", 12)})
    specs = load_specs()
    cluster = layout({"n1": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}})  # one math batch
    log = fresh_client_log(redis_factory, "trainer")
    await log.append(log.names.control, request("r1", n_prompts=9))
    schedulers = {
        name: make_scheduler(fresh_client_log(redis_factory, name), config, specs, cluster,
                             scheduler_id=name, claim_idle_ms=300)
        for name in ("a", "b")
    }
    evaluators = FakeEvaluators(log, ["math"], hold=0, released=False)

    async def first_admitted(admitted: list[Envelope]) -> bool:
        return len(admitted) >= 1

    redis: Any = log.redis  # redis-py's stubs type XPENDING rows loosely
    async with running(list(schedulers.values())):
        await asyncio.wait_for(evaluators.run(first_admitted), TIMEOUT)
        (entry,) = await redis.xpending_range(log.names.control, SCHEDULER_GROUP, "-", "+", 10)
        owner = entry["consumer"].decode()
        peer = schedulers["b" if owner == "a" else "a"]
        # The peer tries to claim every 150 ms; four rounds span two idle windows.
        rounds = peer.claim_rounds + 4
        while peer.claim_rounds < rounds:
            await log.tail({log.names.control: "$"}, block_ms=100)
        (entry,) = await redis.xpending_range(log.names.control, SCHEDULER_GROUP, "-", "+", 10)
        assert entry["consumer"].decode() == owner
        assert entry["times_delivered"] == 1
        evaluators.released = True
        await asyncio.wait_for(evaluators.run(all_admitted(log, ["r1"])), TIMEOUT)
        while await log.pending_count(log.names.control, SCHEDULER_GROUP):
            await log.tail({log.names.pool: "$"}, block_ms=50)
    await assert_exactly_once(log, ["r1"], ["math"])
