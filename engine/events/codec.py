"""msgpack wire format for events. Never pickle.

An event is encoded as one msgpack map ``{"type": ..., "v": schema_version, **fields}``;
packed arrays become msgpack ext values (code 1 int32 ids, 2 float32 logprobs, 3 uint8
masks) holding the raw little-endian bytes. Decoding checks the map shape, looks the type
up in the registry, upcasts older schema versions and validates with pydantic, so what a
reader gets is always a valid current event; anything else raises a :class:`DecodeError`
naming the problem (the log turns it into a dead letter).
"""

from __future__ import annotations

from typing import Any

import msgpack
from pydantic import ValidationError

from engine.errors import DecodeError, EventError
from engine.events.arrays import EXT_TYPES, PackedArray
from engine.events.base import Event, event_class, upcast

_RESERVED = ("type", "v")


def _default(obj: Any) -> Any:
    if isinstance(obj, PackedArray):
        return msgpack.ExtType(obj.ext_code, obj.data)
    if isinstance(obj, tuple | set | frozenset):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} in an event")


def _ext_hook(code: int, data: bytes) -> Any:
    cls = EXT_TYPES.get(code)
    if cls is None:
        raise DecodeError(f"unknown msgpack ext code {code}")
    return cls(data)


def encode(event: Event) -> bytes:
    """Encode a validated event to bytes."""
    payload = event.model_dump(mode="python", exclude_defaults=False)
    payload["v"] = type(event).schema_version
    try:
        out: bytes = msgpack.packb(payload, default=_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EventError(f"cannot encode {event.type}: {exc}") from exc
    return out


def decode_payload(raw: bytes) -> dict[str, Any]:
    """Unpack bytes to the raw map, without validation."""
    try:
        obj = msgpack.unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except DecodeError:
        raise
    except Exception as exc:  # msgpack raises several unrelated classes on garbage
        raise DecodeError(f"not a msgpack event ({type(exc).__name__}: {exc})") from exc
    if not isinstance(obj, dict):
        raise DecodeError(f"event must be a msgpack map, got {type(obj).__name__}")
    return obj


def decode(raw: bytes) -> Event:
    """Decode, upcast and validate one event."""
    payload = decode_payload(raw)
    name = payload.pop("type", None)
    version = payload.pop("v", 1)
    if not isinstance(name, str):
        raise DecodeError("event has no string 'type' field")
    if not isinstance(version, int):
        raise DecodeError(f"{name}: schema version must be an integer, got {version!r}")
    cls = event_class(name)
    payload = upcast(name, version, payload)
    payload["type"] = name
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in exc.errors()[:5]
        )
        raise DecodeError(f"{name} v{version} does not validate: {problems}") from exc
