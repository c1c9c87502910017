"""Arrays read from their compact wire value are lazy: they decode to the values packed,
expand only when their values are used, and re-encode to the very bytes they were read from.
A malformed compact value is refused when the entry is decoded, never later."""

from __future__ import annotations

import pickle
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import DecodeError
from engine.events import Mask, SampleCompleted, TokenIds, decode, encode
from engine.events.arrays import (
    COMPACT_MIN_BYTES,
    PackedArray,
    from_compact,
    to_compact,
)
from engine.events.codec import decode_reference
from engine.events.fastpath import decode_fast


def expanded(array: PackedArray) -> bool:
    """Whether ``array`` holds its values (a lazy one holds only its wire value)."""
    try:
        array._data  # noqa: B018 - the slot itself, not the expanding property
    except AttributeError:
        return False
    return True


# Sizes around the compaction threshold, and a few well beyond it.
_N_IDS = st.one_of(st.integers(0, 2 * COMPACT_MIN_BYTES // 4 + 4), st.integers(0, 3000))
_N_MASK = st.one_of(st.integers(0, 2 * COMPACT_MIN_BYTES + 9), st.integers(0, 5000))


@st.composite
def arrays(draw: st.DrawFn) -> PackedArray:
    """A TokenIds (values fitting uint16, uint24 or only int32) or a Mask (0/1 or any byte)."""
    if draw(st.booleans()):
        high = draw(st.sampled_from([2**16 - 1, 2**24 - 1, 2**31 - 1]))
        low = draw(st.sampled_from([0, 0, -(2**31)]))
        n = draw(_N_IDS)
        seed = draw(st.integers(0, 2**32 - 1))
        values = np.random.default_rng(seed).integers(low, high, n, endpoint=True, dtype="<i4")
        if n and draw(st.booleans()):  # an extreme value at a random place
            values[draw(st.integers(0, n - 1))] = draw(st.sampled_from([low, high]))
        return TokenIds.from_values(values)
    n = draw(_N_MASK)
    seed = draw(st.integers(0, 2**32 - 1))
    pattern = draw(st.sampled_from(["0/1", "0/1", "ones", "runs", "any byte"]))
    rng = np.random.default_rng(seed)
    if pattern == "ones":  # a single turn's sampled tokens
        return Mask.from_values(np.ones(n, "u1"))
    if pattern == "runs":  # turns: sampled tokens, then observation tokens, and so on
        values = np.zeros(n, "u1")
        for start in sorted(rng.integers(0, max(n, 1), 6))[::2]:
            values[start : start + int(rng.integers(1, 200))] = 1
        return Mask.from_values(values)
    top = 1 if pattern == "0/1" else 255
    return Mask.from_values(rng.integers(0, top, n, endpoint=True, dtype="u1"))


@settings(max_examples=300, deadline=None)
@given(array=arrays())
def test_compact_round_trip_is_exact_lazy_and_reencodes_to_the_same_bytes(
    array: PackedArray,
) -> None:
    kind = type(array)
    wire = to_compact(array)
    back = from_compact(kind, wire)
    assert type(back) is kind
    assert len(back) == len(array)
    if wire[0]:  # a compact form: nothing expanded by the length, equality or re-encoding
        assert to_compact(back) is wire
        again = from_compact(kind, wire)
        assert again == back
        assert not expanded(back) and not expanded(again)
    assert back == array and array == back
    assert hash(back) == hash(array)
    assert back.data == array.data
    assert back.tolist() == array.tolist()
    assert np.array_equal(back.numpy(), array.numpy()) and not back.numpy().flags.writeable
    assert back[1:-1] == array[1:-1] and type(back[1:]) is kind
    if len(array):
        assert back[len(array) // 2] == array[len(array) // 2]
    assert repr(back) == repr(array)
    assert pickle.loads(pickle.dumps(back)) == array
    assert to_compact(back) == wire


def _sample(**arrays: Any) -> SampleCompleted:
    n = len(arrays.get("response_ids", ()))
    values: dict[str, Any] = {
        "prompt_ids": [],
        "response_ids": [0] * n,
        "loss_mask": [1] * n,
        "logprobs": [-0.5] * n,
    }
    values.update(arrays)
    return SampleCompleted(rollout_id="r", sample_id="s", **values)


@settings(max_examples=100, deadline=None)
@given(prompt=arrays(), response=arrays(), mask=arrays())
def test_events_with_lazy_arrays_decode_equal_on_both_paths_and_reencode_identically(
    prompt: PackedArray, response: PackedArray, mask: PackedArray
) -> None:
    ids = [a for a in (prompt, response) if isinstance(a, TokenIds)]
    masks = [a for a in (mask, prompt) if isinstance(a, Mask)]
    event = _sample(prompt_ids=ids[0] if ids else [], teacher_mask=masks[0] if masks else [])
    raw = encode(event)
    fast = decode_fast(raw)
    assert isinstance(fast, SampleCompleted)
    ref = decode_reference(raw)
    assert fast == ref == event
    assert encode(fast) == raw and encode(ref) == raw
    assert len(fast.prompt_ids) == len(event.prompt_ids)
    assert fast.teacher_mask.tolist() == event.teacher_mask.tolist()


def test_decoding_expands_nothing_and_first_use_expands_once() -> None:
    event = _sample(
        prompt_ids=list(range(70_000, 70_300)),
        response_ids=list(range(500)),
        loss_mask=[1, 0] * 250,
        logprobs=[-1.0] * 500,
    )
    got = decode(encode(event))
    assert isinstance(got, SampleCompleted)
    lazy = (got.prompt_ids, got.response_ids, got.loss_mask)
    assert not any(expanded(a) for a in lazy)
    assert (len(got.prompt_ids), len(got.response_ids), len(got.loss_mask)) == (300, 500, 500)
    assert not any(expanded(a) for a in lazy)
    data = got.loss_mask.data
    assert expanded(got.loss_mask) and got.loss_mask.data is data  # kept, not re-expanded
    assert got.response_ids.torch().tolist() == list(range(500))
    assert got == event


def _completed(
    n: int,
    *,
    mask: list[int] | None = None,
    versions: list[int] | None = None,
    ids_from: int = 0,
    prompt_key: str = "",
) -> SampleCompleted:
    return SampleCompleted(
        rollout_id="r",
        sample_id="r:s0",
        attempt=1,
        prompt_ids=[] if prompt_key else list(range(ids_from, ids_from + 70)),
        prompt_key=prompt_key,
        response_ids=list(range(ids_from, ids_from + n)),
        logprobs=[-0.5] * n,
        loss_mask=mask if mask is not None else [1] * n,
        reward=1.0,
        n_turns=2,
        token_versions=versions if versions is not None else [3] * n,
        teacher_mask=[0, 1] * (n // 2),
    )


@pytest.mark.parametrize(
    "done",
    [
        _completed(5),
        _completed(300),  # compact: a bit mask, uint16 ids
        _completed(300, ids_from=70_000),  # uint24 ids
        _completed(300, ids_from=2**24),  # raw ids
        _completed(300, mask=[2, 0, 1] * 100),  # not 0/1: a raw mask
        _completed(300, mask=[0, 1, 1] * 100, versions=[1, 2, 2] * 100),
        _completed(9, versions=[]),
        _completed(9, prompt_key="p0"),
    ],
    ids=["short", "bits-u16", "u24", "raw-ids", "raw-mask", "runs", "no-versions", "keyed"],
)
def test_a_fold_reads_a_completed_sample_off_the_compiled_decoder_unexpanded(
    done: SampleCompleted,
) -> None:
    """What a fold reads of a sample (the lengths of its arrays) comes off ``decode`` with
    every compact array still lazy, and equals the event's values."""
    raw = encode(done)
    got = decode_fast(raw)
    assert isinstance(got, SampleCompleted)
    compact = [getattr(got, name) for name in SampleCompleted.compact_arrays]
    lazy = [a for a in compact if not expanded(a)]
    for name in SampleCompleted.compact_arrays:
        assert len(getattr(got, name)) == len(getattr(done, name)), name
    assert not any(expanded(a) for a in lazy)
    assert got.__dict__ == done.__dict__ and got == decode_reference(raw)
    assert encode(got) == raw


def _mask_wire(bits: bytes, pad: int) -> bytes:
    return bytes((1, pad)) + bits


@pytest.mark.parametrize(
    ("kind", "wire", "message"),
    [
        (TokenIds, b"", "empty compact value"),
        (TokenIds, b"\x09" + bytes(8), "unknown compact form \\(tag 9\\)"),
        (TokenIds, b"\x01\x00" + bytes(8), "TokenIds: unknown compact form \\(tag 1\\)"),
        (Mask, b"\x02" + bytes(8), "Mask: unknown compact form \\(tag 2\\)"),
        (Mask, b"\x03" + bytes(9), "Mask: unknown compact form \\(tag 3\\)"),
        (TokenIds, b"\x02" + bytes(7), "7 bytes is not a multiple of 2"),
        (TokenIds, b"\x03" + bytes(8), "8 bytes is not a multiple of 3"),
        (TokenIds, b"\x00" + bytes(6), "6 bytes is not a multiple of 4"),
        (Mask, b"\x01", "bad bit padding"),
        (Mask, _mask_wire(b"", 3), "bad bit padding"),
        (Mask, _mask_wire(b"\x00", 8), "bad bit padding"),
    ],
)
def test_a_malformed_compact_value_is_refused_when_read(
    kind: type[PackedArray], wire: bytes, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        from_compact(kind, wire)
    field = "prompt_ids" if kind is TokenIds else "loss_mask"
    fields = dict(_sample(response_ids=[1]).__dict__)
    for name in ("prompt_ids", "response_ids", "loss_mask", "teacher_mask"):
        fields[name] = to_compact(fields[name])
    for name in ("logprobs", "token_versions"):
        fields[name] = fields[name].data
    fields[field] = wire
    fields["v"] = SampleCompleted.schema_version
    raw = msgpack.packb(fields, use_bin_type=True)
    assert decode_fast(raw) is None
    with pytest.raises(DecodeError, match=f"SampleCompleted v3: {field}: .*{message}"):
        decode(raw)


@settings(max_examples=300, deadline=None)
@given(tag=st.sampled_from([1, 2, 3]), body=st.binary(max_size=64))
def test_every_compact_value_that_is_accepted_expands(tag: int, body: bytes) -> None:
    # The only errors are those of the tag and the length, found when the value is read: a
    # value accepted then always expands, to as many values as its length says.
    kind = Mask if tag == 1 else TokenIds
    try:
        array = from_compact(kind, bytes((tag,)) + body)
    except ValueError:
        return
    n = len(array)
    assert len(array.data) == n * array.itemsize
    assert len(array.tolist()) == n
    if tag == 3:
        assert all(0 <= v < 2**24 for v in array.tolist())
    if tag == 1:
        assert set(array.tolist()) <= {0, 1}


@pytest.mark.parametrize(
    ("kind", "values", "wire"),
    [
        # uint24 for values that fit uint16: re-encoded as uint16
        (
            TokenIds,
            list(range(100)),
            b"\x03" + np.arange(100, dtype="<u4").view("u1").reshape(-1, 4)[:, :3].tobytes(),
        ),
        # a compact form for an array under the threshold: re-encoded raw
        (TokenIds, [5, 6], b"\x02" + np.array([5, 6], "<u2").tobytes()),
        # bits whose padding is not zero: the same values, re-encoded with zero padding
        (Mask, [1] * 300, _mask_wire(b"\xff" * 38, 4)),
    ],
    ids=["u24-for-u16", "compact-short-array", "dirty-padding"],
)
def test_a_non_canonical_compact_value_reads_exactly_and_reencodes_canonically(
    kind: type[PackedArray], values: list[int], wire: bytes
) -> None:
    array = from_compact(kind, wire)
    plain = kind.from_values(values)
    assert array == plain and array.tolist() == values
    assert to_compact(array) == to_compact(plain) != wire
