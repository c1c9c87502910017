"""Codec: round trips, packed arrays, upcasting, refusals."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgpack
import numpy as np
import pytest
import torch
from pydantic import BaseModel

from engine.errors import DecodeError, EventError, SchemaVersionError, UnknownEventType
from engine.events import (
    AbortClass,
    Event,
    LogProbs,
    Mask,
    SampleAborted,
    SampleCompleted,
    TokenIds,
    decode,
    encode,
    registered_types,
    upcaster,
)
from engine.events.arrays import PackedArray, from_wire, to_compact
from engine.events.codec import decode_reference
from engine.events.fastpath import decode_fast
from engine.outcomes import SampleStatus, TerminationReason
from tests.events.examples import example_events


def test_examples_cover_every_registered_type() -> None:
    covered = {type(e).__name__ for e in example_events()}
    production = {n for n, c in registered_types().items() if c.__module__.startswith("engine.")}
    assert production <= covered


@pytest.mark.parametrize("event", example_events(), ids=lambda e: e.type)
def test_round_trip_every_event_type(event: Event) -> None:
    back = decode(encode(event))
    assert back == event
    assert type(back) is type(event)


def test_arrays_are_packed_binary_not_lists() -> None:
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=[1, 2], response_ids=[3],
                         logprobs=[-0.5], loss_mask=[1])
    raw = msgpack.unpackb(encode(ev), raw=False)
    # SampleCompleted v3: ids and masks in the compact form; short ones raw behind tag 0.
    assert raw["prompt_ids"] == b"\x00" + np.array([1, 2], "<i4").tobytes()
    assert raw["logprobs"] == np.array([-0.5], "<f4").tobytes()
    assert raw["loss_mask"] == b"\x00\x01"


def test_long_ids_and_masks_travel_compact_and_come_back_exact() -> None:
    n = 1024
    mask = [1, 1, 0] * (n // 3) + [1] * (n % 3)
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=list(range(70_000, 70_512)),
                         response_ids=[i * 61 % 65_536 for i in range(n)],
                         logprobs=[-0.5] * n, loss_mask=mask, teacher_mask=[2] * n,
                         token_versions=[-1] * n)
    wire = encode(ev)
    raw = msgpack.unpackb(wire, raw=False)
    assert raw["v"] == 3
    assert len(raw["response_ids"]) == 1 + 2 * n  # uint16
    assert len(raw["prompt_ids"]) == 1 + 3 * 512  # 3 bytes per id (above 65,535)
    assert len(raw["loss_mask"]) == 2 + n // 8  # bits
    assert raw["teacher_mask"][:1] == b"\x00"  # not 0/1: raw
    assert raw["token_versions"] == np.array([-1] * n, "<i4").tobytes()  # not compact
    for back in (decode(wire), decode_reference(wire)):
        assert back == ev
        assert encode(back) == wire


def test_a_v2_sample_completed_upcasts_its_raw_arrays() -> None:
    ids = np.arange(300, dtype="<i4").tobytes()
    payload = {"type": "SampleCompleted", "rollout_id": "r", "sample_id": "s",
               "prompt_ids": ids, "response_ids": ids, "logprobs": b"", "loss_mask": b"\x01",
               "v": 2}
    back = decode(msgpack.packb(payload, use_bin_type=True))
    assert isinstance(back, SampleCompleted)
    assert back.prompt_ids == list(range(300)) and back.loss_mask == [1]


def test_a_bad_compact_array_is_refused_by_name() -> None:
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=[], response_ids=[],
                         logprobs=[], loss_mask=[])
    raw = msgpack.unpackb(encode(ev), raw=False)
    raw["response_ids"] = b"\x03\x01\x02\x03\x04"  # uint24 ids in 4 bytes
    with pytest.raises(DecodeError, match="response_ids.*multiple of 3"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw["response_ids"] = b"\x09"
    with pytest.raises(DecodeError, match="response_ids.*unknown compact form"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_arrays_inside_free_form_values_are_self_describing() -> None:
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=[], response_ids=[],
                         logprobs=[], loss_mask=[],
                         metrics={"topk": TokenIds.from_values([7, 8])})
    raw = msgpack.unpackb(encode(ev), raw=False, ext_hook=lambda c, d: (c, d))
    assert raw["metrics"]["topk"] == (1, np.array([7, 8], "<i4").tobytes())
    back = decode(encode(ev))
    assert isinstance(back, SampleCompleted)
    assert back.metrics["topk"] == TokenIds.from_values([7, 8])


def test_views_list_numpy_torch() -> None:
    ids = TokenIds.from_values([5, -1, 2**31 - 1])
    assert ids.tolist() == [5, -1, 2**31 - 1]
    assert ids.numpy().dtype == np.dtype("<i4")
    assert torch.equal(ids.torch(), torch.tensor([5, -1, 2**31 - 1], dtype=torch.int32))
    lp = LogProbs.from_values(np.array([-0.1, -2.5], dtype=np.float32))
    assert lp.numpy().tolist() == np.array([-0.1, -2.5], dtype=np.float32).tolist()
    assert len(Mask.from_values([1, 0, 1])) == 3


def test_float32_logprobs_are_lossless() -> None:
    values = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=[], response_ids=[0] * 1000,
                         logprobs=values, loss_mask=[1] * 1000)
    back = decode(encode(ev))
    assert isinstance(back, SampleCompleted)
    assert np.array_equal(back.logprobs.numpy(), values)


def test_bad_array_values_are_refused_at_the_boundary() -> None:
    with pytest.raises(ValueError, match="must lie in"):
        TokenIds.from_values([2**40])
    with pytest.raises(ValueError, match="integers"):
        TokenIds.from_values([1.5])
    with pytest.raises(ValueError, match="multiple of 4"):
        TokenIds(b"\x00\x01\x02")


def test_64k_token_payload_round_trip() -> None:
    n = 65536
    ids = np.arange(n, dtype=np.int32) % 151_000
    ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=ids[:1024],
                         response_ids=ids, logprobs=np.full(n, -0.75, np.float32),
                         loss_mask=np.ones(n, np.uint8))
    data = encode(ev)
    assert len(data) < n * 9 + 1024 * 4 + 4096  # packed: 4 + 4 + 1 bytes per token
    back = decode(data)
    assert isinstance(back, SampleCompleted)
    assert np.array_equal(back.response_ids.numpy(), ids)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1garbage", "not a msgpack event"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
        (msgpack.packb({"v": 1}), "no string 'type'"),
        (msgpack.packb({"type": "NoSuchEvent", "v": 1}), "unknown event type 'NoSuchEvent'"),
        (msgpack.packb({"type": "RolloutFailed", "v": 1, "rollout_id": "r"}), "reason"),
        (msgpack.packb({"type": "RolloutFailed", "v": 99, "rollout_id": "r", "reason": "x"}),
         "newer than this engine"),
        (msgpack.packb({"type": "RolloutFailed", "v": 1, "rollout_id": "r", "reason": "x",
                        "surprise": 1}), "surprise"),
    ],
)
def test_refusals_name_the_problem(raw: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode(raw)


def test_error_classes() -> None:
    with pytest.raises(UnknownEventType):
        decode(msgpack.packb({"type": "Nope"}))
    with pytest.raises(SchemaVersionError):
        decode(msgpack.packb({"type": "RolloutFailed", "v": 2, "rollout_id": "r", "reason": "x"}))


class _Renamed(Event):
    """A test-only event whose v1 called ``tokens`` what v2 calls ``response_tokens``,
    and whose v2 split ``elapsed_ms`` into seconds in v3."""

    schema_version: ClassVar[int] = 3
    type: Literal["TestRenamed"] = "TestRenamed"
    response_tokens: int
    elapsed_s: float


@upcaster("TestRenamed", from_version=1)
def upcast_v1_v2(payload: dict[str, Any]) -> dict[str, Any]:
    payload = dict(payload)
    payload["response_tokens"] = payload.pop("tokens")
    return payload


@upcaster("TestRenamed", from_version=2)
def upcast_v2_v3(payload: dict[str, Any]) -> dict[str, Any]:
    payload = dict(payload)
    payload["elapsed_s"] = payload.pop("elapsed_ms") / 1000.0
    return payload


def test_upcast_chain_on_read() -> None:
    v1 = msgpack.packb({"type": "TestRenamed", "v": 1, "tokens": 7, "elapsed_ms": 1500})
    ev = decode(v1)
    assert ev == _Renamed(response_tokens=7, elapsed_s=1.5)
    v2 = msgpack.packb({"type": "TestRenamed", "v": 2, "response_tokens": 8, "elapsed_ms": 500})
    assert decode(v2) == _Renamed(response_tokens=8, elapsed_s=0.5)
    assert msgpack.unpackb(encode(ev))["v"] == 3


def test_from_wire_adopts_bytes_and_checks_width() -> None:
    data = np.array([3, -4], "<i4").tobytes()
    ids = from_wire(TokenIds, data)
    assert type(ids) is TokenIds and ids.tolist() == [3, -4] and ids.data is data
    assert from_wire(LogProbs, bytearray(8)) == LogProbs.from_values([0.0, 0.0])
    with pytest.raises(ValueError, match="TokenIds: 5 bytes is not a multiple of 4"):
        from_wire(TokenIds, b"\x00" * 5)


def _msgpack_reference(event: Event) -> bytes:
    """What msgpack's own Packer writes for ``event`` (the format's reference encoder)."""

    def default(obj: Any) -> Any:
        if isinstance(obj, PackedArray):
            return msgpack.ExtType(obj.ext_code, obj.data)
        if isinstance(obj, BaseModel):
            return obj.__dict__
        raise TypeError(type(obj).__name__)

    payload = dict(event.__dict__)
    for name, value in payload.items():
        if name in type(event).model_fields and isinstance(value, PackedArray):
            compact = name in getattr(type(event), "compact_arrays", ())
            payload[name] = to_compact(value) if compact else value.data
    payload["v"] = type(event).schema_version
    out: bytes = msgpack.packb(payload, default=default, use_bin_type=True)
    return out


@pytest.mark.parametrize("event", example_events(), ids=lambda e: e.type)
def test_encoding_is_byte_identical_to_msgpacks_packer(event: Event) -> None:
    assert encode(event) == _msgpack_reference(event)


def test_encoding_free_form_values_matches_msgpack() -> None:
    ev = SampleCompleted(
        rollout_id="r", sample_id="s", prompt_ids=[1], response_ids=[2], logprobs=[-1.0],
        loss_mask=[1],
        metrics={"t": (1, 2), "big": 2**64 - 1, "neg": -(2**63), "f": 0.1, "s": "é" * 40,
                 "b": b"\x00" * 300, "n": None, "nested": [{"x": [True, False]}],
                 "ext": Mask.from_values([1, 0])},
        reward_detail={"np_float": np.float64(0.25)},
    )
    assert encode(ev) == _msgpack_reference(ev)
    back = decode(encode(ev))
    assert isinstance(back, SampleCompleted)
    assert back.reward_detail == {"np_float": 0.25}
    assert type(back.reward_detail["np_float"]) is float


def test_unencodable_values_are_refused_naming_the_event() -> None:
    for bad in ({"o": object()}, {"big": 2**70}):
        ev = SampleCompleted(rollout_id="r", sample_id="s", prompt_ids=[], response_ids=[],
                             logprobs=[], loss_mask=[], metrics=bad)
        with pytest.raises(EventError, match="cannot encode SampleCompleted"):
            encode(ev)


# ---------------------------------------------------------------- outcome enums


def _outcome_wire(**changes: Any) -> bytes:
    fields = {
        "type": "SampleAborted", "producer": "", "causation": None, "rollout_id": "r",
        "sample_id": "s", "attempt": 1, "abort_class": "infra_conn", "error": "",
        "agent_reason": "max_turns", "phase": "run", "elapsed_s": 0.0, "window_s": None,
        "node": "", "turns": 0,
    }
    fields.update(changes)
    fields["v"] = 1
    out: bytes = msgpack.packb(fields, use_bin_type=True)
    return out


def test_outcomes_travel_as_their_strings_and_decode_as_enums() -> None:
    raw = _outcome_wire()
    ev = decode(raw)
    assert decode_fast(raw) == ev  # the compiled path reads enum fields too
    assert isinstance(ev, SampleAborted)
    assert ev.abort_class is AbortClass.INFRA_CONN
    assert ev.agent_reason is TerminationReason.MAX_TURNS
    assert encode(ev) == raw  # the same bytes an older engine wrote
    done = decode(encode(SampleCompleted(
        rollout_id="r", sample_id="s", prompt_ids=[], response_ids=[], logprobs=[],
        loss_mask=[], status="truncated", termination_reason="length")))
    assert isinstance(done, SampleCompleted)
    assert done.status is SampleStatus.TRUNCATED
    assert done.termination_reason is TerminationReason.LENGTH


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"abort_class": "infra_cosmic_ray"}, "abort_class"),
     ({"agent_reason": "stop"}, "agent_reason")],
)
def test_an_outcome_outside_the_family_is_refused_by_name(
    changes: dict[str, Any], field: str
) -> None:
    raw = _outcome_wire(**changes)
    assert decode_fast(raw) is None  # the compiled path declines, the reference names it
    with pytest.raises(DecodeError, match=f"SampleAborted v1 does not validate: {field}"):
        decode(raw)


def test_a_packed_array_equals_the_values_it_packs() -> None:
    ids = TokenIds.from_values([1, 2, 3])
    assert ids == (1, 2, 3) and ids == [1, 2, 3] and ids == np.array([1, 2, 3])
    assert ids != (1, 2) and ids != (1, 2, 2**40) and ids != Mask.from_values([1, 2, 3])
    assert LogProbs.from_values([-0.1]) == (-0.1,)  # compared at the array's float32 width
    assert ids[1:] == TokenIds.from_values([2, 3]) and isinstance(ids[1:], TokenIds)
    assert ids[-1] == 3


def test_peek_reads_the_type_sample_and_group_reference_of_every_event() -> None:
    from engine.events.codec import peek

    for ev in example_events():
        expected = (ev.type, getattr(ev, "sample_id", ""), getattr(ev, "same_as", ""))
        assert peek(encode(ev)) == expected, ev.type
    assert peek(b"") is None and peek(b"\xc1") is None and peek(msgpack.packb([1, 2])) is None
    assert peek(msgpack.packb({"type": "X", "sample_id": 3})) is None  # not a string
