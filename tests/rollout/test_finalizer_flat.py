"""The finalizer's flat read: small events folded from their checked fields, no event built.

A following finalizer reads its rollout stream raw and folds ``SampleStarted``,
``TurnCompleted`` and (when no whole task is kept) ``TaskJoined`` from the fields
``codec.decode_flat`` reads, decoding every other entry as a typed read does. These tests
hold it to the typed fold: the same decisions after every event (the golden digests of
``test_finalizer_compact``), the same fields as ``decode``, and on a real redis-server the
same outcome and the same dead letters, once, for entries that do not decode.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from engine.actors.finalizer import Finalizer, FinalizerConfig
from engine.errors import DecodeError
from engine.events import (
    Envelope,
    Event,
    LogProbs,
    Mask,
    RolloutRequested,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TokenIds,
    TurnCompleted,
)
from engine.events.arrays import PackedArray, compact_size, from_compact
from engine.events.catalog import DeadLetter, PromptStored, RolloutReady, TaskJoined
from engine.events.codec import decode, decode_flat, encode
from engine.events.log import EventLog
from engine.events.redis_log import FIELD, RedisEventLog
from engine.projections import decision as compact
from engine.projections.base import fold, start
from tests.rollout.test_finalizer_compact import GOLDEN, _bench_like, _digest, _rollout


class _FlatFold:
    """The compact fold as the finalizer's flat read drives it: each event encoded, folded
    from ``decode_flat``'s fields when it takes them, else decoded and folded."""

    def __init__(self) -> None:
        self.inner = compact.DecisionProjection()
        self.flat = 0

    def initial(self) -> compact.DecisionState:
        return self.inner.initial()

    def evolve(self, state: compact.DecisionState, env: Envelope) -> compact.DecisionState:
        raw = encode(env.event)
        fields = decode_flat(raw)
        if fields is not None and self.inner.evolve_flat(state, *fields):
            self.flat += 1
            return state
        return self.inner.evolve(state, Envelope(env.stream, env.id, decode(raw)))


def test_the_flat_fold_gives_the_golden_decisions() -> None:
    golden = json.loads(GOLDEN.read_text())
    flat = 0
    for seed in range(160):
        fold_ = _FlatFold()
        digest, _ = _digest(_rollout(seed), projection=fold_)
        assert digest == golden[str(seed)], f"seed {seed}: the decisions changed"
        flat += fold_.flat
    assert flat > 2000  # most starts and turns, and joined tasks, went the flat way


def _small() -> list[Event]:
    started = SampleStarted(rollout_id="r", sample_id="r:s3", attempt=2, batch_id="b",
                            worker="w", node="n", producer="p", causation="x@1-0")
    turn = TurnCompleted(rollout_id="r", sample_id="r:s3", attempt=2, turn=4, gpu=1,
                         tool_calls=["a", "b"], elapsed_s=0.25, weight_version=7)
    joined = TaskJoined(rollout_id="r", sample_id="r:s4", index=4, group_index=1,
                        same_as="r:s3")
    return [started, turn, joined, SampleStarted(rollout_id="r", sample_id="r:s0")]


def test_flat_fields_are_the_decoded_events_fields() -> None:
    for ev in _small():
        raw = encode(ev)
        got = decode_flat(raw)
        assert got is not None
        cls, fields = got
        assert cls is type(ev)
        decoded = decode(raw)
        for name, value in decoded.__dict__.items():
            assert getattr(fields, name) == value, (ev.type, name)


def test_decode_flat_declines_what_it_does_not_check_in_full() -> None:
    # a class with a nested model: its check is that model's validator, decode's
    task = TaskFetched(rollout_id="r", sample_id="r:s0", index=0, group_index=0,
                       prompt="q", dataset="d", task_type="t")
    assert decode_flat(encode(task)) is None
    # not canonical: a lax value decode coerces, a missing default, garbage
    started = SampleStarted(rollout_id="r", sample_id="r:s0", attempt=1)
    lax = {**started.__dict__, "attempt": "1", "v": 1}
    assert decode_flat(msgpack.packb(lax)) is None
    assert decode(msgpack.packb(lax)) == started
    short = {"type": "SampleStarted", "rollout_id": "r", "sample_id": "r:s0", "attempt": 1}
    assert decode_flat(msgpack.packb(short)) is None
    assert decode_flat(b"\xc1 not msgpack") is None
    assert decode_flat(b"") is None


def _completed(n: int, *, mask: list[int] | None = None, versions: list[int] | None = None,
               ids_from: int = 0, prompt_key: str = "") -> SampleCompleted:
    return SampleCompleted(
        rollout_id="r", sample_id="r:s0", attempt=1,
        prompt_ids=TokenIds.from_values([] if prompt_key else list(range(ids_from, ids_from + 70))),
        prompt_key=prompt_key,
        response_ids=TokenIds.from_values(list(range(ids_from, ids_from + n))),
        logprobs=LogProbs.from_values([-0.5] * n),
        loss_mask=Mask.from_values(mask if mask is not None else [1] * n),
        reward=1.0, termination_reason="finish", n_turns=2,
        token_versions=TokenIds.from_values(versions if versions is not None else [3] * n),
        teacher_mask=Mask.from_values([0, 1] * (n // 2)),
    )


COMPLETED = [
    _completed(5),
    _completed(300),  # compact: a bit mask, uint16 ids
    _completed(300, ids_from=70_000),  # uint24 ids
    _completed(300, ids_from=2**24),  # raw ids
    _completed(300, mask=[2, 0, 1] * 100),  # not 0/1: a raw mask
    _completed(300, mask=[0, 1, 1] * 100, versions=[1, 2, 2] * 100),
    _completed(9, versions=[]),
    _completed(9, prompt_key="p0"),
]


def test_a_completed_samples_flat_fields_are_the_decoded_events() -> None:
    for done in COMPLETED:
        raw = encode(done)
        got = decode_flat(raw)
        assert got is not None and got[0] is SampleCompleted
        fields = got[1]
        for name, value in decode(raw).__dict__.items():
            wire = getattr(fields, name)
            if name in SampleCompleted.compact_arrays:
                assert from_compact(type(value), wire) == value
                assert compact_size(type(value), wire) == len(value)
            elif isinstance(value, PackedArray):
                assert wire == value.data
            else:
                assert wire == value, name


def _fold_both(
    events: list[Event],
) -> tuple[compact.DecisionState, compact.DecisionState, int]:
    typed, flat = compact.DecisionProjection(), _FlatFold()
    a, b = typed.initial(), flat.initial()
    for i, ev in enumerate(events):
        env = Envelope("s", f"{i + 1}-0", ev)
        a = typed.evolve(a, Envelope("s", env.id, decode(encode(ev))))
        b = flat.evolve(b, env)
    return a, b, flat.flat


def test_a_completed_sample_folds_flat_as_the_event_does() -> None:
    for algorithm in ("grpo", "dagger_ce"):
        request = RolloutRequested(rollout_id="r", n_prompts=1, n_samples_per_prompt=1,
                                   algorithm=algorithm)
        for done in COMPLETED:
            head: list[Event] = [
                request,
                TaskFetched(rollout_id="r", sample_id="r:s0", index=0, group_index=0,
                            prompt="q", dataset="d", task_type="t"),
                PromptStored(rollout_id="r", prompt_key="p0",
                             prompt_ids=TokenIds.from_values([7] * 12)),
                SampleStarted(rollout_id="r", sample_id="r:s0", attempt=1),
            ]
            typed, flat, n_flat = _fold_both([*head, done])
            assert n_flat == (2 if algorithm == "grpo" else 1)  # the CE lane's: decoded
            assert flat.samples == typed.samples and flat.n_terminal == typed.n_terminal == 1
            assert flat.event_count == typed.event_count
    # a different number of versions than tokens: refused the same way (numpy's IndexError)
    bad = _completed(4, versions=[1, 2])
    with pytest.raises(IndexError):
        _fold_both([request, *head[1:], bad])
    brief = compact.DecisionProjection()
    state = brief.initial()
    plain = RolloutRequested(rollout_id="r", n_prompts=1, n_samples_per_prompt=1)
    for i, ev in enumerate([plain, head[1]]):
        state = brief.evolve(state, Envelope("s", f"{i + 1}-0", ev))
    fields = decode_flat(encode(bad))
    assert fields is not None
    with pytest.raises(IndexError):
        brief.evolve_flat(state, *fields)


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
    reference = compact.decide_ready(
        fold(compact.DecisionProjection(), start(compact.DecisionProjection()), typed).state
    )
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
    from engine.actors.finalizer import _Follower

    assert isinstance(real_log, RedisEventLog)
    stream = real_log.names.rollout("bad")
    ids = [await real_log.redis.xadd(stream, entry) for entry in _bad_entries("bad:s0")[:3]]
    follower = _Follower(real_log, stream)
    assert await follower.read() is False
    assert follower.position == ids[-1].decode()
    assert follower.state.event_count == 0
    assert len(await real_log.read_all(real_log.names.dead)) == 3
