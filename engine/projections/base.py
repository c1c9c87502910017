"""Projections: pure folds of events.

A projection is ``evolve(state, envelope) -> state``: no clock, no randomness, no I/O, nothing
from Redis or files. A state that grows with its stream is updated in place and returned, so
folding stays linear; the fold owns that state. Live actors and the replay tool fold with the
same :func:`fold`, so a replay is identical by construction.

A :class:`Folded` is a snapshot (state + the last stream id applied): entries at or below its
position are skipped, so a redelivered or re-read entry changes nothing. Domain-level
duplicates are each projection's business.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from engine.events.base import Envelope
from engine.events.ids import EMPTY_ID, parse_id

S = TypeVar("S")


class Projection(Protocol[S]):
    """A pure fold over one stream."""

    def initial(self) -> S: ...

    def evolve(self, state: S, env: Envelope) -> S: ...


@runtime_checkable
class Snapshottable(Protocol[S]):
    """A projection whose state can be written as plain msgpack-able values."""

    name: str

    def dump(self, state: S) -> Any: ...

    def load(self, data: Any) -> S: ...


@dataclass(frozen=True, slots=True)
class Folded(Generic[S]):
    """A projection's state and the last stream id folded into it."""

    state: S
    position: str = EMPTY_ID

    def covers(self, entry_id: str) -> bool:
        return parse_id(entry_id) <= parse_id(self.position)


def start(projection: Projection[S]) -> Folded[S]:
    return Folded(projection.initial(), EMPTY_ID)


def fold(
    projection: Projection[S],
    folded: Folded[S],
    envelopes: Iterable[Envelope],
    *,
    until: str | None = None,
) -> Folded[S]:
    """Apply envelopes past ``folded.position`` (and not past ``until``), in order."""
    state, position = folded.state, folded.position
    pos_key = parse_id(position)
    stop = parse_id(until) if until is not None else None
    for env in envelopes:
        key = parse_id(env.id)
        if key <= pos_key:
            continue
        if stop is not None and key > stop:
            break
        state = projection.evolve(state, env)
        position, pos_key = env.id, key
    return Folded(state, position)

