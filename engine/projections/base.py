"""Projections: pure folds of events, and the one rebuild path.

A projection is ``evolve(state, envelope) -> state``: no clock, no randomness, no I/O, and
the state is never mutated in place (return a new value). Live actors and the replay tool
fold with the same :func:`fold` / :func:`rebuild`, so a replay is identical by construction.

Idempotence: a :class:`Folded` remembers the last stream id it applied; entries at or below
it are skipped, so a redelivered or re-read entry changes nothing. Domain-level duplicates
(a second ``SampleCompleted`` for the same ``(sample_id, attempt)``) are the projection's
own business and are ignored inside ``evolve``.

Snapshots: a :class:`Folded` *is* a snapshot (state + position). ``rebuild(..., since=snap)``
folds only the tail after it. Projections that implement :class:`Snapshottable` can also be
stored in Redis with :func:`save_snapshot` / :func:`load_snapshot`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import msgpack

from engine.events.base import Envelope, parse_id
from engine.events.log import EMPTY_ID, EventLog

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


async def rebuild(
    log: EventLog,
    stream: str,
    projection: Projection[S],
    *,
    since: Folded[S] | None = None,
    until: str | None = None,
) -> Folded[S]:
    """Fold ``stream`` from the start (or from the snapshot ``since``) up to ``until``."""
    folded = since if since is not None else start(projection)
    envelopes = await log.read_all(stream, after=folded.position)
    return fold(projection, folded, envelopes, until=until)


async def save_snapshot(log: EventLog, projection: Snapshottable[S], folded: Folded[S]) -> None:
    data = msgpack.packb(
        {"position": folded.position, "state": projection.dump(folded.state)}, use_bin_type=True
    )
    await log.redis.set(log.names.snapshot(projection.name), data)


async def load_snapshot(log: EventLog, projection: Snapshottable[S]) -> Folded[S] | None:
    raw = await log.redis.get(log.names.snapshot(projection.name))
    if raw is None:
        return None
    obj = msgpack.unpackb(raw, raw=False)
    return Folded(projection.load(obj["state"]), str(obj["position"]))
