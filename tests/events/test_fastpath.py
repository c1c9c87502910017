"""The compiled read path gives exactly what the reference path gives, or declines."""

from __future__ import annotations

from typing import Any, Literal

import msgpack
import numpy as np
import pytest
from pydantic import ValidationError

from engine.errors import DecodeError
from engine.events import (
    Event,
    LogProbs,
    RolloutFailed,
    RolloutRequested,
    SampleCompleted,
    TokenAcquired,
    TokenIds,
    decode,
    encode,
    registered_types,
)
from engine.events.arrays import to_compact
from engine.events.codec import decode_reference
from engine.events.fastpath import decode_fast, fast_types
from tests.events.examples import example_events


def _json(event: Event) -> str:
    try:
        return event.model_dump_json()
    except ValueError as exc:  # e.g. DeadLetter.raw holding bytes that are not UTF-8
        return f"refused: {exc}"


def assert_same(fast: Event, ref: Event) -> None:
    assert type(fast) is type(ref)
    assert fast == ref
    assert list(fast.__dict__) == list(ref.__dict__)  # field order, so re-encoding matches
    assert repr(fast) == repr(ref)
    assert fast.model_fields_set == ref.model_fields_set
    assert fast.model_dump() == ref.model_dump()
    assert _json(fast) == _json(ref)
    assert encode(fast) == encode(ref)


def test_every_engine_event_type_takes_the_fast_path() -> None:
    # Nested records (PoolDeclared.nodes, TokenAcquired.tokens, RolloutRequested.filters,
    # TailCarried.tasks), field bounds (RolloutRequested.n_prompts >= 1) and after-validators
    # (RolloutRequested's carry rule) are all read by the compiled path.
    production = {n for n, c in registered_types().items() if c.__module__.startswith("engine.")}
    assert production <= fast_types()


@pytest.mark.parametrize("event", example_events(), ids=lambda e: e.type)
def test_every_example_decodes_identically(event: Event) -> None:
    raw = encode(event)
    fast = decode_fast(raw)
    assert fast is not None  # a canonical entry never needs the reference path
    assert_same(fast, decode_reference(raw))
    assert encode(fast) == raw


def _request_wire(**changes: Any) -> bytes:
    fields = dict(RolloutRequested(rollout_id="r", n_prompts=2).__dict__)
    fields["filters"] = fields["filters"].__dict__
    fields["v"] = RolloutRequested.schema_version
    fields.update(changes)
    return _wire(**fields)


def test_field_bounds_and_validators_are_checked_on_the_fast_path() -> None:
    ok = _request_wire(n_samples_per_prompt=None, request_stream="s", tail="carry")
    ev = decode_fast(ok)
    assert isinstance(ev, RolloutRequested) and ev.tail == "carry"
    assert_same(ev, decode_reference(ok))
    for changes, message in [
        ({"n_prompts": 0}, "n_prompts"),
        ({"n_samples_per_prompt": 0}, "n_samples_per_prompt"),
        ({"overprovision": 16.5}, "overprovision"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"request_stream": ""}, "request_stream"),
        ({"tail": "carry", "request_stream": None}, "needs a request_stream"),
        ({"filters": {"finish_only": "maybe"}}, "filters.finish_only"),
    ]:
        raw = _request_wire(**changes)
        assert decode_fast(raw) is None, changes
        with pytest.raises(DecodeError, match=message):
            decode(raw)


def test_nested_records_in_lists_are_validated_on_the_fast_path() -> None:
    grant = {
        "token_id": "t",
        "node": "n",
        "gpus": [{"gpu": 0, "fraction": 0.5}],
        "cpu": 1.0,
        "memory_gb": 0.0,
    }
    fields = {
        "type": "TokenAcquired",
        "producer": "",
        "causation": None,
        "rollout_id": "r",
        "batch_id": "b",
        "evaluator_id": "e",
        "tokens": [grant],
    }
    ev = decode_fast(_wire(**fields))
    assert isinstance(ev, TokenAcquired) and ev.tokens[0].gpus[0].fraction == 0.5
    assert_same(ev, decode_reference(_wire(**fields)))
    fields["tokens"] = [{**grant, "gpus": [{"gpu": "zero", "fraction": 0.5}]}]
    assert decode_fast(_wire(**fields)) is None
    with pytest.raises(DecodeError, match="tokens.0.gpus.0.gpu"):
        decode(_wire(**fields))


def _random_sample(rng: np.random.Generator, i: int) -> SampleCompleted:
    n = int(rng.integers(0, 300))
    detail: dict[str, Any] = {
        "score": float(rng.normal()),
        "count": int(rng.integers(-(2**40), 2**40)),
        "flags": [bool(b) for b in rng.integers(0, 2, 3)],
        "nested": {"a": None, "b": ["x", 1, 2.5, {"deep": "é" * int(rng.integers(0, 40))}]},
        "blob": bytes(rng.integers(0, 256, 5, dtype=np.uint8)),
        "topk": TokenIds.from_values(rng.integers(0, 1000, 4)),
        "lp": LogProbs.from_values(-rng.random(3, dtype=np.float32)),
    }
    return SampleCompleted(
        rollout_id=f"r{i}",
        sample_id=f"r{i}-{i}",
        attempt=int(rng.integers(0, 3)),
        prompt_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        response_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=-rng.random(n, dtype=np.float32),
        loss_mask=rng.integers(0, 2, n, np.uint8),
        reward=float(rng.normal()),
        reward_detail=detail,
        status="completed",
        termination_reason="max_turns" if i % 2 else None,
        response_text="ok " * (i % 7),
        n_turns=i % 5,
        elapsed_s=float(rng.random()),
        policy_version=i,
        metrics=detail if i % 3 else {},
        causation=None if i % 2 else f"rl:s@{i}-0",
        producer="p",
    )


def test_random_samples_decode_identically() -> None:
    rng = np.random.default_rng(11)
    for i in range(200):
        ev = _random_sample(rng, i)
        raw = encode(ev)
        fast = decode_fast(raw)
        assert fast is not None
        assert_same(fast, decode_reference(raw))
        assert fast == ev


def test_fast_events_are_frozen_and_copy_cleanly() -> None:
    ev = decode_fast(encode(RolloutFailed(rollout_id="r", reason="x")))
    assert isinstance(ev, RolloutFailed)
    with pytest.raises(ValidationError):
        ev.reason = "y"  # type: ignore[misc]
    copy = ev.model_copy(update={"producer": "w"})
    assert copy.producer == "w" and ev.producer == ""
    assert copy.model_fields_set is not ev.model_fields_set
    assert hash(ev) == hash(RolloutFailed(rollout_id="r", reason="x"))


def _wire(**fields: Any) -> bytes:
    # keep the canonical key order: type first, v last
    payload = {"type": fields.pop("type"), **fields}
    payload["v"] = payload.pop("v", 1)
    out: bytes = msgpack.packb(payload, use_bin_type=True)
    return out


BASE_SAMPLE: dict[str, Any] = dict(
    SampleCompleted(
        rollout_id="r",
        sample_id="s",
        prompt_ids=[1],
        response_ids=[2, 3],
        logprobs=[-0.5, -0.25],
        loss_mask=[1, 1],
    ).__dict__
)


def _sample_wire(**changes: Any) -> bytes:
    fields = dict(BASE_SAMPLE)
    for name in (
        "prompt_ids",
        "response_ids",
        "logprobs",
        "loss_mask",
        "token_versions",
        "teacher_mask",
    ):
        compact = name in SampleCompleted.compact_arrays  # v3: the compact wire form
        fields[name] = to_compact(fields[name]) if compact else fields[name].data
    fields["v"] = SampleCompleted.schema_version
    fields.update(changes)
    return _wire(**{k: v for k, v in fields.items() if v is not _DROP})


_DROP = object()


def test_canonical_hand_written_entry_is_taken() -> None:
    ev = decode_fast(_sample_wire())
    assert isinstance(ev, SampleCompleted)
    assert ev.response_ids.tolist() == [2, 3]


@pytest.mark.parametrize(
    ("changes", "expect"),
    [
        # values pydantic's lax mode coerces: the fast path declines, pydantic coerces
        ({"attempt": 1.0}, {"attempt": 1}),
        ({"n_turns": "3"}, {"n_turns": 3}),
        # an omitted default: pydantic fills it in and leaves it out of the fields set
        ({"attempt": _DROP}, {"attempt": 0}),
        # a declared array sent as a self-describing ext value
        (
            {"prompt_ids": msgpack.ExtType(1, np.array([9], "<i4").tobytes())},
            {"prompt_ids": TokenIds.from_values([9])},
        ),
    ],
    ids=["float-for-int", "str-for-int", "omitted-default", "array-as-ext"],
)
def test_non_canonical_entries_go_to_pydantic(
    changes: dict[str, Any], expect: dict[str, Any]
) -> None:
    raw = _sample_wire(**changes)
    assert decode_fast(raw) is None
    ev = decode(raw)
    for name, value in expect.items():
        assert getattr(ev, name) == value
    if changes.get("attempt") is _DROP:
        assert "attempt" not in ev.model_fields_set


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not a msgpack event"),
        (b"\xc1garbage", "not a msgpack event"),
        (_sample_wire(surprise=1), "surprise"),
        (_sample_wire(loss_mask=_DROP, surprise=1), "loss_mask"),
        (_sample_wire(rollout_id=None), "rollout_id"),
        (_sample_wire(logprobs=b"\x00" * 6), "logprobs"),
        (_sample_wire(metrics={"x": msgpack.ExtType(42, b"")}), "ext code 42"),
        (_sample_wire(v=7), "newer than this engine"),
        (_wire(type="NoSuchEvent", a=1), "unknown event type"),
        (_sample_wire(type="RolloutFailed", v=1), "does not validate"),
    ],
    ids=[
        "empty",
        "garbage",
        "extra-key",
        "swapped-key",
        "none-for-str",
        "ragged-array",
        "unknown-ext",
        "newer-version",
        "unknown-type",
        "wrong-type-name",
    ],
)
def test_bad_entries_are_declined_and_refused_by_the_reference(raw: bytes, message: str) -> None:
    assert decode_fast(raw) is None
    with pytest.raises(DecodeError, match=message):
        decode(raw)


def test_small_events_use_fixmap_and_large_ones_map16() -> None:
    small = encode(RolloutFailed(rollout_id="r", reason="x"))
    large = _sample_wire()
    assert 0x80 <= small[0] <= 0x8F and large[0] == 0xDE
    assert decode_fast(small) is not None and decode_fast(large) is not None


def _probe_class(extra: bool) -> type[Event]:
    if extra:

        class Probe(Event):
            type: Literal["TestFastProbe"] = "TestFastProbe"
            a: int
            b: str = ""
    else:

        class Probe(Event):  # type: ignore[no-redef]
            type: Literal["TestFastProbe"] = "TestFastProbe"
            a: int

    return Probe


def test_redefining_an_event_class_drops_its_compiled_plan() -> None:
    one = _probe_class(extra=False)
    ev = decode_fast(encode(one(a=1)))
    assert type(ev) is one
    two = _probe_class(extra=True)
    assert decode_fast(encode(one(a=1))) is None  # no longer canonical for the new class
    ev = decode_fast(encode(two(a=2, b="x")))
    assert type(ev) is two and ev == two(a=2, b="x")
