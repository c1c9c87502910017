"""The finalizer follows a rollout in the fold's memory and owns its stream's bad entries.

The fold keeps a record of a few hundred bytes a sample, not the events: a finalizer
following a large rollout holds a small fraction of what the events weigh, and its
``RolloutReady`` is the decision over the fold of the stream. An entry that does not
decode is skipped by the fold and dead-lettered once, by the finalizer that follows the
rollout (the stream's owner).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from engine.actors.finalizer import Finalizer, FinalizerConfig, decide_ready
from engine.errors import DecodeError
from engine.events import (
    Envelope,
    Event,
    LogProbs,
    Mask,
    RolloutPlanned,
    RolloutRequested,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TokenIds,
    TurnCompleted,
)
from engine.events.catalog import DeadLetter, RolloutReady, TaskJoined
from engine.events.codec import decode, encode
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog
from engine.projections.base import fold, start
from engine.projections.rollout import RolloutProjection
from engine.runtime.consumer import Backoff


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


def test_the_fold_is_small_per_sample() -> None:
    """4,000 samples of 200 response tokens: the fold keeps a few hundred bytes a sample
    (bound generous: 1 KB), a small fraction of the events it folds."""
    n_groups, per = 500, 8
    n = n_groups * per

    def held(keep: bool) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            projection = RolloutProjection()
            state = projection.initial()
            kept: list[Envelope] = []
            for env in _bench_like(n_groups, per):
                state = projection.evolve(state, env)
                if keep:
                    kept.append(env)
            gc.collect()
            after = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert state.n_terminal == n
        return after - before

    fold_bytes = held(False) / n
    events_bytes = held(True) / n
    assert fold_bytes < 1024, f"{fold_bytes:.0f} bytes per sample"
    assert fold_bytes * 4 < events_bytes, (fold_bytes, events_bytes)


async def test_the_live_finalizer_follows_a_rollout_in_compact_memory(real_log: EventLog) -> None:
    """A real finalizer following a 4,000-sample rollout on a real redis-server: its peak
    traced memory stays a small fraction of what the stream's events weigh, and its
    ``RolloutReady`` is the decision over the fold of the stream, byte for byte."""
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
    envs = [env for env in await log.read_all(stream) if not isinstance(env.event, RolloutReady)]
    p = RolloutProjection()
    reference = decide_ready(fold(p, start(p), envs).state)
    assert reference is not None
    assert encode(reference, producer="p") == encode(outcome, producer="p")  # the log's own
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        whole = await log.read_all(stream)
        whole_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(whole) > 3 * n
    assert peak < whole_bytes / 3, (peak / n, whole_bytes / n)


def _bad_entries(first: str) -> list[dict[bytes, bytes]]:
    """Entries that do not decode (and one that decodes only the lax way)."""
    started = SampleStarted(rollout_id="big", sample_id=first, attempt=1)
    turn = TurnCompleted(rollout_id="big", sample_id=first, attempt=1, turn=1)
    return [
        {FIELD: b"\xc1 not msgpack"},
        {FIELD: msgpack.packb({**started.__dict__, "attempt": "x", "v": 1})},
        {b"other": b"no event field"},
        {FIELD: msgpack.packb({**turn.__dict__, "extra": 1, "v": 1})},
        {FIELD: msgpack.packb({**turn.__dict__, "attempt": "1", "turn": "1", "v": 1})},
    ]


@pytest.mark.parametrize("block_ms", [200, 0])
async def test_the_finalizer_skips_and_dead_letters_bad_entries_as_a_typed_read(
    real_log: EventLog, block_ms: int
) -> None:
    """Bad entries among a rollout's: the finalizer's outcome is the typed fold's, and the
    dead-letter stream holds each entry that does not decode once, with decode's reason --
    also when a second finalizer follows the decided rollout."""
    assert isinstance(real_log, RedisEventLog)
    log = RedisEventLog(real_log.redis, producer="test", block_ms=block_ms)
    stream = log.names.rollout("big")
    events = [env.event for env in _bench_like(3, 4, tokens=8)]
    bad = _bad_entries("big:s0")
    for ev in events:
        await log.append(stream, ev)
        if isinstance(ev, SampleStarted) and ev.sample_id == "big:s0":
            for entry in bad:  # among the samples' lifecycles
                await log.redis.xadd(stream, entry)
    raw = await log.read_raw(stream)
    expected: dict[str, str] = {}
    for entry_id, data in raw:
        if not data:
            expected[entry_id] = f"entry has no {FIELD.decode()!r} field"
            continue
        try:
            decode(data)
        except DecodeError as exc:
            expected[entry_id] = str(exc)
    assert len(expected) == 4
    typed = await log.read_all(stream)  # skips what does not decode, writes nothing
    p = RolloutProjection()
    reference = decide_ready(fold(p, start(p), typed).state)
    assert reference is not None and reference.sample_ids

    outcome = await Finalizer(log, FinalizerConfig(consumer="f1")).follow("big")
    assert isinstance(outcome, RolloutReady)
    assert encode(outcome, producer="p") == encode(reference, producer="p")

    def letters(envs: list[Envelope]) -> dict[str, str]:
        out: dict[str, str] = {}
        for env in envs:
            letter: Any = env.event
            assert isinstance(letter, DeadLetter) and letter.source_stream == stream
            assert letter.source_id not in out
            out[letter.source_id] = letter.error
        return out

    assert letters(await log.read_all(log.names.dead)) == expected
    again = await Finalizer(log, FinalizerConfig(consumer="f2")).follow("big")
    assert again == outcome
    assert letters(await log.read_all(log.names.dead)) == expected  # once each


async def test_a_read_of_only_bad_entries_folds_nothing_and_moves_past_them(
    real_log: EventLog,
) -> None:
    """As ``read_after``: nothing decoded is "nothing read" (a dead request's follower then
    appends its RolloutFailed at once), and the position moves past the bad entries."""
    from engine.actors.finalizer import _Rollout

    assert isinstance(real_log, RedisEventLog)
    stream = real_log.names.rollout("bad")
    ids = [await real_log.redis.xadd(stream, entry) for entry in _bad_entries("bad:s0")[:3]]
    follower = _Rollout(real_log, stream, block_ms=100, backoff=Backoff())
    assert await follower.read(timeout=1.0) == []
    assert follower.position == ids[-1].decode()
    assert follower.state.n_entries == 0
    assert len(await real_log.read_all(real_log.names.dead)) == 3
