"""The compiled read path: msgspec decodes and checks a canonical entry in one C pass.

``codec.decode`` takes this path for every entry in the canonical form ``encode`` writes: a
map whose first key is ``type``, holding every field of the class once plus ``v`` equal to
the current schema version. For each event class this module derives a ``msgspec.Struct``
with the same field names, order and types (pydantic's field bounds become msgspec
``Meta`` bounds), decodes the wire bytes straight into it and builds the pydantic instance
the way ``model_construct`` does. A field holding nested models is kept as raw msgpack and
validated by pydantic for that field alone (a single frozen model is cached by its bytes:
the events of a rollout repeat the same few values); the class's ``after`` model validators
run on the built event. Packed arrays in the compact form are built lazily
(``arrays.from_compact``). :func:`checked` stops before the event: the checked struct, for a
fold that reads a few fields of many entries (the finalizer's).

What this path refuses or cannot express goes to ``codec.decode_reference`` (msgpack +
pydantic), which upcasts older versions, applies omitted defaults, coerces lax values or
names the problem. msgspec is strict (an ``int`` field refuses ``1.0`` or ``"1"``, a ``bool``
refuses ``1``), so every value it accepts pydantic's lax mode accepts with the same result.
A class with field, ``before`` or ``wrap`` validators, aliases or private attributes has no
plan. Every event this path decodes equals the reference path's result, field for field,
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
from typing import Annotated, Any

import msgspec
from pydantic import BaseModel, TypeAdapter

from engine.errors import DecodeError
from engine.events.arrays import EXT_TYPES, PackedArray, wire_array
from engine.events.base import Event, on_register, registered_types

_TYPE_KEY = b"\xa4type"  # msgpack fixstr "type"
_SCALARS: tuple[type, ...] = (str, int, float, bool, bytes)
# pydantic's field bounds (annotated-types metadata) and the msgspec Meta argument for each
_BOUNDS = {
    "Ge": "ge",
    "Gt": "gt",
    "Le": "le",
    "Lt": "lt",
    "MinLen": "min_length",
    "MaxLen": "max_length",
}


def ext_array(code: int, data: bytes | memoryview) -> PackedArray:
    """The packed array a self-describing msgpack ext value holds (both decoders' hook)."""
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


def _bounded(spec: Any, metadata: list[Any]) -> Any:
    """``spec`` under the bounds pydantic reads from ``metadata`` (``Field(ge=1)``, ...),
    as msgspec checks them; None for metadata without an equivalent. A bound on an
    optional field applies to its value, as in pydantic."""
    bounds: dict[str, Any] = {}
    for item in metadata:
        key = _BOUNDS.get(type(item).__name__)
        if key is None:
            return None
        bounds[key] = getattr(item, key)
    meta = msgspec.Meta(**bounds)
    if typing.get_origin(spec) is typing.Union:
        parts = typing.get_args(spec)
        if len(parts) != 2 or type(None) not in parts:
            return None
        (inner,) = (p for p in parts if p is not type(None))
        return typing.Optional[Annotated[inner, meta]]  # noqa: UP045
    return Annotated[spec, meta]


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in typing.get_args(annotation))


Nested = Callable[[msgspec.Raw], Any]


@dataclass(frozen=True, slots=True)
class _Plan:
    """How to decode one event class fast."""

    cls: type[Event]
    decode: Callable[[bytes], Any]
    n_keys: int  # every field plus "v"
    fields: set[str]  # every field: the events' fields set (each gets a copy)
    arrays: tuple[tuple[str, type[PackedArray], bool], ...]  # name, class, compact form
    nested: tuple[tuple[str, Nested], ...]  # fields validated by pydantic, from raw msgpack
    checks: tuple[Callable[[Any], Any], ...]  # the class's after-validators


_NESTED: dict[tuple[type[BaseModel], bytes], BaseModel] = {}
_NESTED_MAX = 4096
_raw_decode = msgspec.msgpack.Decoder(ext_hook=ext_array).decode


def _frozen_model(cls: type[BaseModel]) -> Nested:
    """The validated ``cls`` held in raw msgpack, cached by its bytes (it is frozen)."""

    def validate(raw: msgspec.Raw) -> BaseModel:
        key = (cls, bytes(raw))
        value = _NESTED.get(key)
        if value is None:
            value = cls.model_validate(_raw_decode(key[1]))  # ValidationError: a ValueError
            if len(_NESTED) >= _NESTED_MAX:
                _NESTED.clear()
            _NESTED[key] = value
        return value

    return validate


def _adapted(annotation: Any) -> Nested:
    """The value of type ``annotation`` held in raw msgpack, validated by pydantic."""
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)
    return lambda raw: adapter.validate_python(_raw_decode(raw))


def _plan(cls: type[Event]) -> _Plan | None:
    decorators = cls.__pydantic_decorators__
    if (
        decorators.validators
        or decorators.field_validators
        or decorators.root_validators
        or any(d.info.mode != "after" for d in decorators.model_validators.values())
        or cls.__private_attributes__
        or cls.__pydantic_post_init__ is not None
        or cls.model_config.get("extra") != "forbid"
    ):
        return None
    fields: list[tuple[str, Any]] = []
    arrays: list[tuple[str, type[PackedArray], bool]] = []
    compact_names = frozenset(getattr(cls, "compact_arrays", ()))
    nested: list[tuple[str, Nested]] = []
    for name, info in cls.model_fields.items():
        if info.alias or info.validation_alias:
            return None
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, PackedArray):
            if info.metadata:
                return None
            arrays.append((name, annotation, name in compact_names))
            spec: Any = bytes  # declared arrays travel as bin (codec.encode)
        elif _holds_model(annotation):
            if info.metadata:
                return None
            if (
                isinstance(annotation, type)
                and issubclass(annotation, BaseModel)
                and annotation.model_config.get("frozen")
            ):
                nested.append((name, _frozen_model(annotation)))
            else:
                nested.append((name, _adapted(annotation)))
            spec = msgspec.Raw
        else:
            spec = _spec(annotation)
            if spec is not None and info.metadata:
                spec = _bounded(spec, info.metadata)
            if spec is None:
                return None
        fields.append((name, spec))
    fields.append(("v", typing.Literal[cls.schema_version]))
    try:
        struct = msgspec.defstruct(f"_Wire{cls.__name__}", fields, forbid_unknown_fields=True)
        decoder = msgspec.msgpack.Decoder(struct, ext_hook=ext_array)
    except TypeError:  # a union msgspec cannot tell apart
        return None
    return _Plan(
        cls=cls,
        decode=decoder.decode,
        n_keys=len(fields),
        fields={name for name, _ in fields[:-1]},
        arrays=tuple(arrays),
        nested=tuple(nested),
        checks=tuple(d.func for d in decorators.model_validators.values()),
    )


_PLANS: dict[bytes, _Plan | None] = {}
# The plan of each class by the exact head of its canonical entries: the map's header with
# its key count, the ``type`` key and the class's name. One slice and one lookup find the
# plan of a canonical entry; a miss takes ``_canonical_plan``, which makes plans.
_HEADS: dict[bytes, _Plan] = {}
_LOCK = threading.Lock()


def _head(name: bytes, n_keys: int) -> bytes:
    """The first bytes of a canonical entry of the class ``name`` with ``n_keys`` keys."""
    size = n_keys.to_bytes(2, "big")
    header = bytes((0x80 | n_keys,)) if n_keys < 16 else b"\xde" + size
    return header + _TYPE_KEY + bytes((0xA0 + len(name),)) + name


def _plan_for(name: bytes) -> _Plan | None:
    """The plan of the class named ``name`` (None: it has none), made on first use."""
    with _LOCK:
        if name not in _PLANS:
            cls = registered_types().get(name.decode("utf-8", "replace"))
            plan = _PLANS[name] = None if cls is None else _plan(cls)
            if plan is not None and len(name) < 32:
                _HEADS[_head(name, plan.n_keys)] = plan
        return _PLANS[name]


def _forget(name: str) -> None:
    with _LOCK:
        plan = _PLANS.pop(name.encode(), None)
        if plan is not None:
            _HEADS.pop(_head(name.encode(), plan.n_keys), None)


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
    name = raw[at + 6 : at + 6 + size]
    plan = _PLANS[name] if name in _PLANS else _plan_for(name)
    if plan is None or plan.n_keys != n_keys:
        return None
    return plan


def _lookup(raw: bytes) -> _Plan | None:
    """:func:`_canonical_plan`, by the head first."""
    try:
        at = 1 if raw[0] < 0x90 else 3  # a fixmap's header is one byte, a map 16's three
        plan = _HEADS.get(raw[: at + 6 + raw[at + 5] - 0xA0])
    except IndexError:
        return None
    return plan if plan is not None else _canonical_plan(raw)


def checked(raw: bytes) -> tuple[type[Event], Any] | None:
    """``(class, fields)`` of an entry :func:`decode_fast` decodes, without building the
    event: ``fields`` is the msgspec struct it is built from, every field checked, with the
    event's field names and values (packed arrays built). None where :func:`decode_fast`
    returns None, and for a class with nested models or after-validators (checked only on
    the built event). For a fold that reads a few fields of many entries."""
    plan = _lookup(raw)
    if plan is None or plan.nested or plan.checks:
        return None
    try:
        return plan.cls, _read(plan, raw)
    except _Refused:
        return None


def _read(plan: _Plan, raw: bytes) -> Any:
    """``raw`` decoded into ``plan``'s struct, its packed arrays built (compact ones lazy:
    expanded on first use)."""
    fields = plan.decode(raw)
    for name, kind, compact in plan.arrays:
        setattr(fields, name, wire_array(kind, getattr(fields, name), compact))
    return fields


def decode_fast(raw: bytes) -> Event | None:
    """The event in ``raw`` if it is in canonical form for a class with a plan, else None."""
    plan = _lookup(raw)
    if plan is None:
        return None
    try:
        values = _asdict(plan.decode(raw))
        for name, kind, compact in plan.arrays:
            values[name] = wire_array(kind, values[name], compact)
        for field, validate in plan.nested:
            values[field] = validate(values[field])
    except _Refused:
        return None
    del values["v"]
    event = _new(plan.cls)
    _set(event, "__dict__", values)
    _set(event, "__pydantic_fields_set__", plan.fields.copy())
    _set(event, "__pydantic_extra__", None)
    _set(event, "__pydantic_private__", None)
    if plan.checks:
        try:
            for check in plan.checks:
                event = check(event)
        except (ValueError, AssertionError):
            return None
    return event


def fast_types() -> set[str]:
    """The registered event types the fast path decodes (for tests and the bench)."""
    return {name for name in registered_types() if _plan_for(name.encode()) is not None}


# ---------------------------------------------------------------- the write side

_E = typing.TypeVar("_E", bound=Event)


def trusted(cls: type[_E], values: dict[str, Any], fields_set: frozenset[str]) -> _E:
    """An event of ``cls`` holding ``values``, built without validation, the way
    :func:`decode_fast` builds one: for a producer whose every value already has its
    field's exact type (they come from validated records), where pydantic would only
    check them again. ``values`` holds every field, in the class's field order (check the
    layout once with :func:`field_layout`); ``fields_set`` is the keys the validated
    construction would have been passed. The result equals ``cls(**passed)`` field for
    field (``tests/actors/test_outcomes.py`` holds the sample path to that)."""
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
