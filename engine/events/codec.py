"""msgpack wire format for events. Never pickle.

An event is encoded as one msgpack map ``{"type": ..., **fields, "v": schema_version}``.
A field declared as a packed array (``TokenIds`` int32, ``LogProbs`` float32, ``Mask``
uint8) is stored as msgpack bin holding its raw little-endian bytes, or the compact form of
``arrays.py`` for the fields a class lists in ``compact_arrays``; the event class says how
to read it back. A packed array anywhere else (inside a free-form value) becomes a
self-describing msgpack ext value (code 1 int32, 2 float32, 3 uint8).

:func:`decode` reads an entry in the canonical form ``encode`` writes through the compiled
path (``fastpath.py``), whatever its type. :func:`decode_reference` (msgpack + pydantic)
reads everything else: it upcasts older schema versions and fills in omitted defaults, or
raises a :class:`DecodeError` naming the problem (the log turns it into a dead letter).
Either way a reader gets a valid current event or the error.
"""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import msgspec
from pydantic import BaseModel, ValidationError

from engine.errors import DecodeError, EventError
from engine.events.arrays import (
    PackedArray,
    from_compact,
    from_wire,
    to_compact,
)
from engine.events.base import Event, event_class, upcast
from engine.events.fastpath import decode_fast, ext_array

_RESERVED = ("type", "v")


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, PackedArray):
        return msgspec.msgpack.Ext(obj.ext_code, obj.data)
    if isinstance(obj, BaseModel):  # nested records: their validated field values
        return obj.__dict__
    if isinstance(obj, float):  # subclasses such as numpy.float64 pack as plain floats
        return float(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, str):
        return str(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in an event")


_LOCAL = threading.local()


def _encoder() -> msgspec.msgpack.Encoder:
    # One encoder per thread: reusing one saves its set-up on every event.
    encoder: msgspec.msgpack.Encoder | None = getattr(_LOCAL, "encoder", None)
    if encoder is None:
        encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        _LOCAL.encoder = encoder
    return encoder


ArrayField = tuple[str, type[PackedArray], bool]
_ARRAY_FIELDS: dict[type[Event], tuple[ArrayField, ...]] = {}


def array_fields(cls: type[Event]) -> tuple[ArrayField, ...]:
    """The fields of ``cls`` declared as packed arrays: name, array class, and whether the
    field travels in the compact form (the class's ``compact_arrays``; see ``arrays.py``)."""
    fields = _ARRAY_FIELDS.get(cls)
    if fields is None:
        compact = frozenset(getattr(cls, "compact_arrays", ()))
        fields = tuple(
            (name, info.annotation, name in compact)
            for name, info in cls.model_fields.items()
            if isinstance(info.annotation, type) and issubclass(info.annotation, PackedArray)
        )
        _ARRAY_FIELDS[cls] = fields
    return fields


def encode(event: Event, *, producer: str | None = None, causation: str | None = None) -> bytes:
    """Encode a validated event to bytes (``producer`` / ``causation`` override its own).

    The event's validated field values are packed directly (no ``model_dump``): frozen
    models hold only msgpack-able values, packed arrays and nested records, which
    ``_enc_hook`` handles. msgspec's encoder writes the same bytes as msgpack's Packer
    (``use_bin_type``, float64, smallest ints) in about half the time, and encoding is
    part of every append.
    """
    payload = dict(event.__dict__)
    for name, _kind, compact in array_fields(type(event)):
        # A field typed as a packed array travels as plain msgpack bin (its class says
        # how to read it), in the compact form where the class asks for it; arrays
        # anywhere else become self-describing ext values.
        payload[name] = to_compact(payload[name]) if compact else payload[name].data
    if producer is not None:
        payload["producer"] = producer
    if causation is not None:
        payload["causation"] = causation
    payload["v"] = type(event).schema_version
    try:
        out: bytes = _encoder().encode(payload)
    except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
        raise EventError(f"cannot encode {event.type}: {exc}") from exc
    return out


class _Head(msgspec.Struct):
    """What :func:`peek` reads of an entry; every other key is skipped unparsed."""

    type: str
    sample_id: str = ""
    same_as: str = ""


_peek_head = msgspec.msgpack.Decoder(_Head).decode


def peek(raw: bytes) -> tuple[str, str, str] | None:
    """``(type, sample_id, same_as)`` of an encoded event, read without decoding the rest
    (the empty string for a key it does not have); None when the bytes do not read as an
    event map. It validates nothing: a reader that keeps the entry decodes it with
    :func:`decode`, which upcasts and checks as always. For readers that skip most of
    what they read (a worker looking for its batch's tasks in a rollout stream)."""
    try:
        head = _peek_head(raw)
    except (msgspec.MsgspecError, ValueError, TypeError):
        return None
    return head.type, head.sample_id, head.same_as


def decode_payload(raw: bytes) -> dict[str, Any]:
    """Unpack bytes to the raw map, without validation."""
    try:
        obj = msgpack.unpackb(raw, ext_hook=ext_array, raw=False, strict_map_key=True)
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises several unrelated classes on garbage
        raise DecodeError(f"not a msgpack event ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"event must be a msgpack map, got {type(obj).__name__}")
    return obj


def decode(raw: bytes) -> Event:
    """Decode, upcast and validate one event: the compiled path for a canonical entry,
    :func:`decode_reference` for an older version, a non-canonical entry or an error."""
    event = decode_fast(raw)
    return event if event is not None else decode_reference(raw)


def decode_reference(raw: bytes) -> Event:
    """Decode, upcast and validate one event with msgpack and pydantic (the reference)."""
    payload = decode_payload(raw)
    name = payload.pop("type", None)
    version = payload.pop("v", 1)
    if not isinstance(name, str):
        raise DecodeError("event has no string 'type' field")
    if not isinstance(version, int):
        raise DecodeError(f"{name}: schema version must be an integer, got {version!r}")
    cls = event_class(name)
    if version != cls.schema_version:
        payload = upcast(name, version, payload)
    payload["type"] = name
    for field, kind, compact in array_fields(cls):
        value = payload.get(field)
        if type(value) is bytes:  # the wire form: build the array, pydantic checks its class
            try:
                payload[field] = from_compact(kind, value) if compact else from_wire(kind, value)
            except ValueError as exc:
                raise DecodeError(f"{name} v{version}: {field}: {exc}") from exc
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise DecodeError(f"{name} v{version} does not validate: {problems}") from exc
