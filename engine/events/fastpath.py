"""A compiled read path for events: msgspec decodes and checks an entry in one C pass.

Reading is the hot side of the log (every rebuild, the finalizer, replay). The reference
path in ``codec.decode`` unpacks msgpack into a dict and validates it with pydantic: about
9 us for a 256-token ``SampleCompleted``, over twice what hiredis takes to fetch the
entry. This module derives, for each event class whose fields it can express exactly, a
``msgspec.Struct`` with the same field names, order and types, and decodes the wire bytes
straight into it (about 1.5 us), then builds the pydantic instance the way
``model_construct`` does.

It is only an accelerator; the reference path stays the authority:
* it takes an entry only when it is in the canonical form ``encode`` writes: a map whose
  first key is ``type``, holding every field of the class once plus ``v`` equal to the
  current schema version. Anything else (older versions to upcast, omitted defaults,
  extra keys, garbage) returns ``None`` and goes the reference way, which upcasts,
  applies defaults or names the problem;
* it checks no less than pydantic does: msgspec is strict (an ``int`` field refuses
  ``1.0`` or ``"1"``, a ``bool`` refuses ``1``), so every value it accepts pydantic's lax
  mode accepts with the same result, and whatever it refuses goes to pydantic, which
  coerces or refuses as before;
* classes it cannot express exactly are left to the reference path: field constraints
  (``Field(ge=1)``), validators, aliases, private attributes, nested models inside
  containers, non-scalar defaults are not translated. A field typed as one nested frozen
  model (``TaskFetched.stopping``) is kept as raw msgpack and validated by that model's own
  pydantic validator, exactly what the reference path runs for it; since events of a rollout
  repeat the same few values, the validated (immutable) instance is cached by its bytes.

Every event the fast path decodes equals the reference path's result, field for field,
with the same field order (so re-encoding gives the same bytes) and the same
``model_fields_set``; ``tests/events/test_fastpath.py`` holds it to that for every type.
"""

from __future__ import annotations

import enum
import threading
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from engine.errors import DecodeError
from engine.events.arrays import (
    EXT_TYPES,
    PackedArray,
    compact_size,
    from_compact,
    from_wire,
)
from engine.events.base import Event, on_register, registered_types

_TYPE_KEY = b"\xa4type"  # msgpack fixstr "type"
_SCALARS: tuple[type, ...] = (str, int, float, bool, bytes)


def _ext_hook(code: int, data: memoryview) -> Any:
    cls = EXT_TYPES.get(code)
    if cls is None:
        raise DecodeError(f"unknown msgpack ext code {code}")
    return cls(bytes(data))


def _spec(annotation: Any) -> Any:
    """The msgspec type that checks exactly what pydantic checks for ``annotation``, or
    ``None`` when there is none (the class then keeps the reference path)."""
    if annotation is Any or annotation in _SCALARS or annotation is type(None):
        return annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return annotation if all(type(a) in (str, int) for a in args) else None
    if origin in (types.UnionType, typing.Union):
        parts = [_spec(a) for a in args]
        return None if any(p is None for p in parts) else typing.Union[tuple(parts)]  # noqa: UP007
    if origin is list and len(args) == 1:
        inner = _spec(args[0])
        return None if inner is None else list[inner]  # type: ignore[valid-type]
    if origin is dict and len(args) == 2 and args[0] is str:
        inner = _spec(args[1])
        return None if inner is None else dict[str, inner]  # type: ignore[valid-type]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        inner = _spec(args[0])
        return None if inner is None else tuple[inner, ...]  # type: ignore[valid-type]
    return None


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to decode one event class fast."""

    cls: type[Event]
    decode: Callable[[bytes], Any]
    n_keys: int  # every field plus "v"
    fields: frozenset[str]
    arrays: tuple[tuple[str, type[PackedArray]], ...]
    compact: tuple[tuple[str, type[PackedArray]], ...]  # arrays in the compact form
    nested: tuple[tuple[str, type[BaseModel]], ...]


_NESTED: dict[tuple[type[BaseModel], bytes], BaseModel] = {}
_NESTED_MAX = 4096
_raw_decode = msgspec.msgpack.Decoder(ext_hook=_ext_hook).decode


def _nested_value(cls: type[BaseModel], raw: msgspec.Raw) -> BaseModel:
    """The validated ``cls`` held in ``raw`` (cached by its bytes; instances are frozen)."""
    key = (cls, bytes(raw))
    value = _NESTED.get(key)
    if value is None:
        value = cls.model_validate(_raw_decode(key[1]))  # ValidationError is a ValueError
        if len(_NESTED) >= _NESTED_MAX:
            _NESTED.clear()
        _NESTED[key] = value
    return value


def _plan(cls: type[Event]) -> _Plan | None:
    decorators = cls.__pydantic_decorators__
    if (
        decorators.validators
        or decorators.field_validators
        or decorators.root_validators
        or decorators.model_validators
        or cls.__private_attributes__
        or cls.__pydantic_post_init__ is not None
        or cls.model_config.get("extra") != "forbid"
    ):
        return None
    fields: list[tuple[str, Any]] = []
    arrays: list[tuple[str, type[PackedArray]]] = []
    compact: list[tuple[str, type[PackedArray]]] = []
    compact_names = frozenset(getattr(cls, "compact_arrays", ()))
    nested: list[tuple[str, type[BaseModel]]] = []
    for name, info in cls.model_fields.items():
        if info.metadata or info.alias or info.validation_alias:
            return None
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, PackedArray):
            (compact if name in compact_names else arrays).append((name, annotation))
            spec: Any = bytes  # declared arrays travel as bin (codec.encode)
        elif (
            isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
            and annotation.model_config.get("frozen")
        ):
            nested.append((name, annotation))
            spec = msgspec.Raw
        else:
            spec = _spec(annotation)
            if spec is None:
                return None
        fields.append((name, spec))
    fields.append(("v", typing.Literal[cls.schema_version]))
    try:
        struct = msgspec.defstruct(
            f"_Wire{cls.__name__}", fields, forbid_unknown_fields=True
        )
        decoder = msgspec.msgpack.Decoder(struct, ext_hook=_ext_hook)
    except TypeError:  # a union msgspec cannot tell apart
        return None
    return _Plan(
        cls=cls,
        decode=decoder.decode,
        n_keys=len(fields),
        fields=frozenset(name for name, _ in fields[:-1]),
        arrays=tuple(arrays),
        compact=tuple(compact),
        nested=tuple(nested),
    )


_PLANS: dict[bytes, _Plan | None] = {}
_LOCK = threading.Lock()


def _plan_for(name: bytes) -> _Plan | None:
    if name in _PLANS:
        return _PLANS[name]
    with _LOCK:
        cls = registered_types().get(name.decode("utf-8", "replace"))
        plan = None if cls is None else _plan(cls)
        _PLANS[name] = plan
    return plan


def _forget(name: str) -> None:
    _PLANS.pop(name.encode(), None)


on_register(_forget)

_new = object.__new__
_set = object.__setattr__
_asdict = msgspec.structs.asdict
_Refused = (msgspec.MsgspecError, DecodeError, ValueError)


def _canonical_plan(raw: bytes) -> _Plan | None:
    """The plan of ``raw``'s class when ``raw`` is a map in canonical form for it (``type``
    first, one key per field plus ``v``), else None."""
    head = raw[0] if raw else 0
    if 0x80 <= head <= 0x8F:  # fixmap
        n_keys, at = head & 0x0F, 1
    elif head == 0xDE:  # map 16
        n_keys, at = (raw[1] << 8) | raw[2], 3
    else:
        return None
    if not raw.startswith(_TYPE_KEY, at):
        return None
    size = raw[at + 5] - 0xA0
    if not 0 <= size < 32:  # the type name is a fixstr
        return None
    start = at + 6
    plan = _plan_for(raw[start : start + size])
    if plan is None or plan.n_keys != n_keys:
        return None
    return plan


def decode_flat(raw: bytes) -> tuple[type[Event], Any] | None:
    """``(class, fields)`` of an event read into its class's checked msgspec struct without
    building the event; None for anything :func:`decode_fast` would not take (another
    class, not canonical, refused) and for a class with a nested model field.

    Every field is read and checked as :func:`decode_fast` checks it, packed arrays
    included (their lengths and compact forms, without building them): whenever this
    returns fields, :func:`engine.events.codec.decode` returns the event with these values.
    A packed array stays in its wire form in the struct -- the raw little-endian bytes, or
    for a field of the class's ``compact_arrays`` the compact value (``arrays.from_compact``
    / ``arrays.compact_size`` read it). For folds that need a few fields of many events
    (the finalizer's): whatever this declines, the reader decodes the usual way, which
    accepts, upcasts or refuses it as always."""
    plan = _canonical_plan(raw)
    if plan is None or plan.nested:
        return None
    try:
        fields = plan.decode(raw)
        for name, kind in plan.arrays:
            if len(getattr(fields, name)) % kind.itemsize:
                return None
        for name, kind in plan.compact:
            compact_size(kind, getattr(fields, name))
    except _Refused:
        return None
    return plan.cls, fields


def decode_fast(raw: bytes) -> Event | None:
    """The event in ``raw`` if it is in canonical form for a class with a plan, else None."""
    plan = _canonical_plan(raw)
    if plan is None:
        return None
    try:
        values = _asdict(plan.decode(raw))
        for field, kind in plan.arrays:
            values[field] = from_wire(kind, values[field])
        for field, kind in plan.compact:
            values[field] = from_compact(kind, values[field])  # lazy: expanded on first use
        for field, model in plan.nested:
            values[field] = _nested_value(model, values[field])
    except _Refused:
        return None
    del values["v"]
    event = _new(plan.cls)
    _set(event, "__dict__", values)
    _set(event, "__pydantic_fields_set__", set(plan.fields))
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    return event


def fast_types() -> set[str]:
    """The registered event types the fast path decodes (for tests and the bench)."""
    return {
        name for name in registered_types() if _plan_for(name.encode()) is not None
    }


# ---------------------------------------------------------------- the write side

_E = typing.TypeVar("_E", bound=Event)


def trusted(cls: type[_E], values: dict[str, Any], fields_set: frozenset[str]) -> _E:
    """An event of ``cls`` holding ``values``, built without validation, the way
    :func:`decode_fast` builds one: for a producer whose every value already has its
    field's exact type (they come from validated records), where pydantic would only
    check them again. ``values`` holds every field, in the class's field order (check the
    layout once with :func:`field_layout`); ``fields_set`` is the keys the validated
    construction would have been passed. The result equals ``cls(**passed)`` field for
    field (``tests/rollout/test_outcomes.py`` holds the sample path to that)."""
    event = _new(cls)
    _set(event, "__dict__", values)
    _set(event, "__pydantic_fields_set__", set(fields_set))
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    return event


def field_layout(cls: type[Event], names: tuple[str, ...]) -> frozenset[str]:
    """Check that ``names`` are ``cls``'s fields in order (raise ``TypeError`` naming the
    difference: a producer of :func:`trusted` values is stale); the fields a producer
    passes, i.e. all but ``type`` and ``producer``."""
    actual = tuple(cls.model_fields)
    if actual != names:
        raise TypeError(
            f"{cls.__name__}: a trusted builder lists the fields {names}, the class has {actual}"
        )
    return frozenset(names) - {"type", "producer"}
