"""The finalizer's compact fold (engine/projections/decision.py): decisions and memory.

The live finalizer decides from :class:`DecisionState` (a few hundred bytes a sample); its
rules exist once, in ``engine.projections.decision``. Until commit b6a3b14 a second,
full-state copy of them (from :class:`RolloutState`, every event kept) lived in the engine
as the reference; both gave the same digest of every decision on every rollout below. That
copy is gone (two copies of the rules diverge silently); its digests stay as golden
expectations in ``golden/compact_decisions.json``: on seeded, varied rollouts -- filters,
aborts, retries, duplicate terminals, stale tokens, over-provisioned tails (aborted and
carried), carried samples, the per-token and CE lanes, prompts stored once, tasks joined to
their group -- the decisions after every event, the ``RolloutReady`` and tail-event bytes
and the ``summary.json`` bytes hash to what the full-state rules gave. A rule changed on
purpose changes a digest: regenerate the file then, and say why in the commit. Further
tests bound the compact state's memory.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import random
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.errors import RolloutError
from engine.events import (
    AbortClass,
    Envelope,
    Event,
    FilterSpec,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TeacherScored,
    TokenIds,
    TurnCompleted,
)
from engine.events.catalog import PromptStored, RolloutReady, TaskJoined
from engine.events.codec import encode
from engine.events.log import EventLog
from engine.projections import decision as compact
from engine.projections.base import fold, start
from engine.projections.rollout import RolloutProjection
from engine.projections.summary import dumps
from engine.runtime.rebuild import rebuild

REASONS = ["finish", "finish", "max_turns", "length", None]
ABORTS = [AbortClass.INFRA_CONN, AbortClass.AGENT_TIMEOUT, AbortClass.STALE,
          AbortClass.INFRA_SANDBOX]


def _request(rng: random.Random, rid: str, n_prompts: int, per: int) -> RolloutRequested:
    algorithm = rng.choice(["grpo", "grpo", "opd", "dagger_ce", "dagger_k3"])
    knobs: dict[str, Any] = {}
    if algorithm == "dagger_ce" and rng.random() < 0.7:
        knobs["max_seq_len"] = rng.choice([6, 9, 14])
    overprovision = rng.choice([1.0, 1.0, 1.5, 2.0])
    tail = rng.choice(["abort", "carry"])
    return RolloutRequested(
        rollout_id=rid,
        iteration=rng.randrange(5),
        kind=rng.choice(["train", "train", "eval"]),
        n_prompts=n_prompts,
        n_samples_per_prompt=per,
        policy_version=rng.randrange(4),
        seed=rng.randrange(100),
        algorithm=algorithm,
        knobs=knobs,
        filters=FilterSpec(
            reject_equal_rewards=rng.random() < 0.4, finish_only=rng.random() < 0.3
        ),
        teacher_capture=rng.random() < 0.2,
        max_staleness=rng.choice([None, None, 0, 1, 3]),
        overprovision=overprovision,
        tail=tail,
        request_stream="run" if tail == "carry" else rng.choice([None, "run"]),
    )


def _completed(
    rng: random.Random, rid: str, sid: str, attempt: int, prompt_key: str
) -> SampleCompleted:
    n = rng.randrange(1, 9)
    mask = [rng.choice([0, 1, 1]) for _ in range(n)]
    versions: list[int] = []
    if rng.random() < 0.8:
        versions = [rng.choice([-1, 0, 1, 2, 3, 3, 4]) if rng.random() < 0.3 else 3
                    for _ in range(n)]
    teacher = [rng.choice([0, 1]) for _ in range(n)] if rng.random() < 0.6 else []
    cuts = sorted(rng.sample(range(1, n + 2), min(n + 1, rng.randrange(3))))
    return SampleCompleted(
        rollout_id=rid, sample_id=sid, attempt=attempt,
        prompt_ids=TokenIds.from_values([] if prompt_key else [1] * rng.randrange(1, 5)),
        prompt_key=prompt_key,
        response_ids=TokenIds.from_values(list(range(n))),
        logprobs=LogProbs.from_values([-0.5] * n),
        loss_mask=Mask.from_values(mask),
        reward=rng.choice([0.0, 0.0, 1.0, 0.5, -1.0]),
        termination_reason=rng.choice(REASONS),
        n_turns=rng.choice([0, 1, 3]),
        token_versions=TokenIds.from_values(versions),
        teacher_mask=Mask.from_values(teacher),
        student_cut_points=cuts,
    )


def _rollout(seed: int) -> list[Event]:
    """A seeded rollout's events, lifecycles interleaved across samples."""
    rng = random.Random(seed)
    rid = f"r{seed}"
    per = rng.randrange(1, 5)
    request = _request(rng, rid, rng.randrange(1, 4), per)
    n_groups = request.n_planned_prompts
    head: list[Event] = [request]
    prompts = {g: f"p{g}" for g in range(n_groups) if rng.random() < 0.5}
    for g, key in prompts.items():
        head.append(PromptStored(rollout_id=rid, prompt_key=key,
                                 prompt_ids=TokenIds.from_values([7] * (g + 1))))
    sids: list[str] = []
    for g in range(n_groups):
        dataset = rng.choice(["math", "code"])
        carried = rng.choice([None, None, "older"])
        first: TaskFetched | None = None
        for c in range(per):
            i = g * per + c
            sid = f"{rid}:s{i}"
            sids.append(sid)
            task = TaskFetched(rollout_id=rid, sample_id=sid, index=i, group_index=g,
                               prompt=f"q{g}", dataset=dataset, task_type="t",
                               carried_from=carried)
            if first is None or rng.random() < 0.3:
                head.append(task)
                first = first or task
            else:
                joined = TaskJoined.of(task, first)
                assert joined is not None
                head.append(joined)
            if rng.random() < 0.1:
                head.append(task)  # a duplicate task: ignored
    head.append(RolloutPlanned(rollout_id=rid, n_samples=len(sids), n_batches=1))
    lives: list[list[Event]] = []
    for i, sid in enumerate(sids):
        g = i // per
        life: list[Event] = []
        attempts = rng.choice([1, 1, 2, 3])
        for attempt in range(attempts):
            life.append(SampleStarted(rollout_id=rid, sample_id=sid, attempt=attempt,
                                      node="n0"))
            for turn in range(rng.randrange(3)):
                life.append(TurnCompleted(rollout_id=rid, sample_id=sid, attempt=attempt,
                                          turn=turn))
        last = attempts - 1
        fate = rng.random()
        if fate < 0.12:
            lives.append(life)  # never terminal (a tail, or a rollout still running)
            continue
        if fate < 0.3:
            life.append(SampleAborted(rollout_id=rid, sample_id=sid, attempt=last,
                                      abort_class=rng.choice(ABORTS),
                                      turns=rng.randrange(3)))
        else:
            done = _completed(rng, rid, sid, rng.choice([last, last, max(0, last - 1)]),
                              prompts.get(g, ""))
            life.append(done)
            if rng.random() < 0.5:
                life.append(TeacherScored(
                    rollout_id=rid, sample_id=sid, attempt=rng.choice([done.attempt] * 3 + [9]),
                    teacher_logprobs=LogProbs.from_values([-1.0] * len(done.response_ids)),
                ))
        if rng.random() < 0.15:  # a late duplicate terminal: ignored
            life.append(SampleAborted(rollout_id=rid, sample_id=sid, attempt=last + 1,
                                      abort_class=AbortClass.INFRA_OTHER))
        lives.append(life)
    body: list[Event] = []
    while any(lives):
        life = rng.choice([x for x in lives if x])
        body.append(life.pop(0))
    return head + body


# Per seed of _rollout, the digest of every decision (see _digest).
GOLDEN = Path(__file__).parent / "golden" / "compact_decisions.json"


def _envs(events: list[Event]) -> Iterator[Envelope]:
    for i, ev in enumerate(events):
        yield Envelope("s", f"{i + 1}-0", ev)


def _digest(events: list[Event], rules: Any = None, projection: Any = None) -> tuple[str, int]:
    """Every decision after every event of ``events`` (worth deciding, carried sources, the
    group selection, capture, ready, tail aborts and carried tail, for four trainer
    versions), then the summaries once the decided ready is appended, hashed into one
    digest. Returns ``(digest, ready decisions made)``.

    ``rules`` and ``projection`` default to the engine's (the compact fold); the golden
    digests were made by passing the full-state rules and ``RolloutProjection`` of commit
    b6a3b14, when both implementations lived in the engine and agreed on every rollout."""
    rules = rules if rules is not None else compact
    fold_ = projection if projection is not None else compact.DecisionProjection()
    h = hashlib.sha256()

    def put(ev: Any) -> None:
        h.update(b"-" if ev is None else encode(ev, producer="p"))
        h.update(b"|")

    state = fold_.initial()
    decided = 0
    for env in _envs(events):
        state = fold_.evolve(state, env)
        sources = rules.carried_sources(state)
        h.update(repr((rules.worth_deciding(state),
                       sorted((k, sorted(v)) for k, v in sources.items()))).encode())
        sel = rules.select_groups(state)
        h.update(repr(None if sel is None else
                      ([x.sample_id for x in sel.samples], sel.tail)).encode())
        for trainer in (None, 0, 2, 5):
            put(rules.decide_capture(state, top_k=3, trainer_version=trainer))
            ready = rules.decide_ready(state, trainer)
            put(ready)
            if ready is not None:
                decided += 1
                for ev in rules.tail_aborts(state, ready):
                    put(ev)
                put(rules.tail_carried(state, ready))
    for trainer in (None, 2):
        ready = rules.decide_ready(state, trainer)
        if ready is None:
            continue
        after = state.copy() if hasattr(state, "copy") else copy.deepcopy(state)
        for env in _envs([ready, *rules.tail_aborts(state, ready)]):
            after = fold_.evolve(after, env)
        h.update(dumps(rules.build_summary(after)).encode())
    h.update(dumps(rules.build_summary(state)).encode())
    return h.hexdigest(), decided


def test_compact_decisions_match_the_golden_full_state_ones_on_varied_rollouts() -> None:
    golden = json.loads(GOLDEN.read_text())
    assert len(golden) == 160
    decided = 0
    lanes: set[str] = set()
    for seed in range(160):
        events = _rollout(seed)
        request = events[0]
        assert isinstance(request, RolloutRequested)
        digest, n = _digest(events)
        assert digest == golden[str(seed)], f"seed {seed}: the decisions changed"
        decided += n
        lanes.add(request.algorithm)
    assert decided > 100  # the comparison reached many ready decisions
    assert lanes >= {"grpo", "opd", "dagger_ce", "dagger_k3"}


def test_a_joined_task_or_prompt_the_stream_lacks_is_named() -> None:
    brief = compact.DecisionProjection()
    joined = TaskJoined(rollout_id="r", sample_id="r:s1", index=1, group_index=0,
                        same_as="r:s0")
    with pytest.raises(RolloutError, match="r:s0"):
        brief.evolve(brief.initial(), Envelope("s", "1-0", joined))
    state = brief.initial()
    task = TaskFetched(rollout_id="r", sample_id="r:s0", index=0, group_index=0, prompt="q",
                       dataset="d", task_type="t")
    state = brief.evolve(state, Envelope("s", "1-0", task))
    done = SampleCompleted(
        rollout_id="r", sample_id="r:s0", prompt_ids=TokenIds.empty(), prompt_key="missing",
        response_ids=TokenIds.from_values([1]), logprobs=LogProbs.from_values([-1.0]),
        loss_mask=Mask.from_values([1]),
    )
    with pytest.raises(RolloutError, match="missing"):
        brief.evolve(state, Envelope("s", "2-0", done))


def _bench_like(n_groups: int, per: int = 8, tokens: int = 200) -> Iterator[Envelope]:
    """A rollout shaped like the bench's (group task stored once, one turn, ``tokens``
    response tokens), built lazily so only what the fold keeps stays in memory."""
    rid = "big"
    n = n_groups * per
    yield Envelope("s", "1-0", RolloutRequested(rollout_id=rid, n_prompts=n_groups,
                                                n_samples_per_prompt=per))
    seq = 2
    for g in range(n_groups):
        first = TaskFetched(rollout_id=rid, sample_id=f"{rid}:s{g * per}", index=g * per,
                            group_index=g, prompt=f"question {g}" * 8, label=str(g),
                            dataset="bench", task_type="fast")
        yield Envelope("s", f"{seq}-0", first)
        seq += 1
        for c in range(1, per):
            i = g * per + c
            yield Envelope("s", f"{seq}-0", TaskJoined(
                rollout_id=rid, sample_id=f"{rid}:s{i}", index=i, group_index=g,
                same_as=first.sample_id))
            seq += 1
    yield Envelope("s", f"{seq}-0", RolloutPlanned(rollout_id=rid, n_samples=n, n_batches=1))
    seq += 1
    for i in range(n):
        sid = f"{rid}:s{i}"
        for ev in (
            SampleStarted(rollout_id=rid, sample_id=sid, attempt=1, batch_id="b", node="n"),
            TurnCompleted(rollout_id=rid, sample_id=sid, attempt=1, turn=0,
                          response_tokens=tokens),
            SampleCompleted(
                rollout_id=rid, sample_id=sid, attempt=1,
                prompt_ids=TokenIds.from_values(range(40)),
                response_ids=TokenIds.from_values(range(tokens)),
                logprobs=LogProbs.from_values([-0.25] * tokens),
                loss_mask=Mask.from_values([1] * tokens), reward=float(i % 2),
                termination_reason="finish", n_turns=1,
                token_versions=TokenIds.from_values([0] * tokens),
            ),
        ):
            yield Envelope("s", f"{seq}-0", ev)
            seq += 1


def test_the_compact_state_is_small_per_sample() -> None:
    """4,000 samples of 200 response tokens: the compact state keeps a few hundred bytes a
    sample (bound generous: 1 KB), where the full fold keeps the trajectories (several KB)."""
    n_groups, per = 500, 8
    n = n_groups * per

    def held(projection: Any) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            state = projection.initial()
            for env in _bench_like(n_groups, per):
                state = projection.evolve(state, env)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert state.n_terminal == n
        return after - before

    compact_bytes = held(compact.DecisionProjection()) / n
    full_bytes = held(RolloutProjection()) / n
    assert compact_bytes < 1024, f"{compact_bytes:.0f} bytes per sample"
    assert compact_bytes * 4 < full_bytes, (compact_bytes, full_bytes)


async def test_the_live_finalizer_follows_a_rollout_in_compact_memory(real_log: EventLog) -> None:
    """A real finalizer following a 4,000-sample rollout on a real redis-server: its peak
    traced memory stays a small fraction of what the whole fold keeps (the events), and its
    ``RolloutReady`` is the full-state decision's, byte for byte."""
    log = real_log
    n_groups, per = 500, 8
    n = n_groups * per
    stream = log.names.rollout("big")
    batch: list[tuple[str, Event]] = []
    for env in _bench_like(n_groups, per):
        batch.append((stream, env.event))
        if len(batch) == 1000:
            await log.append_many(batch)
            batch = []
    if batch:
        await log.append_many(batch)
    finalizer = Finalizer(log, FinalizerConfig(consumer="f-compact", block_ms=200))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        outcome = await finalizer.follow("big")
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert isinstance(outcome, RolloutReady) and len(outcome.sample_ids) == n
    whole = await rebuild(log, stream, RolloutProjection())
    reference = compact.decide_ready(
        fold(compact.DecisionProjection(), start(compact.DecisionProjection()), [
            env for env in await log.read_all(stream) if not isinstance(env.event, RolloutReady)
        ]).state
    )
    assert reference is not None
    assert encode(reference, producer="p") == encode(outcome, producer="p")  # the log's own
    assert whole.state.ready == outcome
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = await rebuild(log, stream, RolloutProjection())
        whole_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept.state.n_terminal == n
    assert peak < whole_bytes / 3, (peak / n, whole_bytes / n)


if __name__ == "__main__":
    # A rule changed on purpose: rewrite the golden digests from the engine's rules
    # (`PYTHONPATH=$PWD python -m tests.rollout.test_finalizer_compact`) and say why in
    # the commit.
    GOLDEN.write_text(
        json.dumps({str(seed): _digest(_rollout(seed))[0] for seed in range(160)},
                   indent=1, sort_keys=True) + "\n"
    )
