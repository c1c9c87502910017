"""The event base class, the type registry and schema upcasting.

Every event is a frozen pydantic v2 model with a ``type`` literal (its registry key) and a
``schema_version`` class constant. Subclasses register themselves when defined; one
registry maps ``type`` to class. An event read with an older schema version is upcast
step by step (``v1 -> v2 -> ...``) by the functions registered with :func:`upcaster`
before it is validated; a newer version than this engine knows is refused (and so goes to
the dead letters), since guessing at a future schema would corrupt a fold.

Envelope fields shared by every event: ``producer`` (which process wrote it) and
``causation`` (``stream@id`` of the event that caused this one), so ``rollout tail`` can
explain any event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from engine.errors import SchemaVersionError, UnknownEventType

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

_REGISTRY: dict[str, type[Event]] = {}
_UPCASTERS: dict[tuple[str, int], Upcaster] = {}
_ON_REGISTER: list[Callable[[str], None]] = []


class Event(BaseModel):
    """Base of every event. Subclasses set ``type: Literal["Name"] = "Name"``."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    schema_version: ClassVar[int] = 1

    type: str
    producer: str = ""
    causation: str | None = None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        name = cls.model_fields["type"].default
        if not isinstance(name, str) or not name:
            raise TypeError(f"{cls.__name__} must declare type: Literal[...] = '...'")
        if name in _REGISTRY and _REGISTRY[name].__qualname__ != cls.__qualname__:
            raise TypeError(f"event type {name!r} registered twice")
        _REGISTRY[name] = cls
        for hook in _ON_REGISTER:
            hook(name)


def on_register(hook: Callable[[str], None]) -> None:
    """Call ``hook(type)`` whenever an event class is registered (or re-registered), so
    caches derived from a class can drop what they hold for that type."""
    _ON_REGISTER.append(hook)


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register ``fn`` to turn a ``from_version`` payload of ``event_type`` into the next one."""

    def register(fn: Upcaster) -> Upcaster:
        key = (event_type, from_version)
        if key in _UPCASTERS:
            raise TypeError(f"two upcasters for {event_type} v{from_version}")
        _UPCASTERS[key] = fn
        return fn

    return register


def event_class(name: str) -> type[Event]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownEventType(f"unknown event type {name!r}") from None


def registered_types() -> dict[str, type[Event]]:
    return dict(_REGISTRY)


def upcast(name: str, version: int, payload: dict[str, Any]) -> dict[str, Any]:
    """Bring ``payload`` written at ``version`` up to the registered class's version."""
    cls = event_class(name)
    current = cls.schema_version
    if version > current:
        raise SchemaVersionError(
            f"{name} has schema version {version}, newer than this engine's v{current}"
        )
    if version < 1:
        raise SchemaVersionError(f"{name} has invalid schema version {version}")
    while version < current:
        fn = _UPCASTERS.get((name, version))
        if fn is None:
            raise SchemaVersionError(f"no upcaster for {name} from v{version} to v{version + 1}")
        payload = fn(payload)
        version += 1
    return payload


@dataclass(frozen=True, slots=True)
class Envelope:
    """An event as read from the log: where it lives and what it says."""

    stream: str
    id: str
    event: Event

    @property
    def ref(self) -> str:
        """``stream@id``: the value to put in a caused event's ``causation``."""
        return f"{self.stream}@{self.id}"

