"""Folding a projection from the log: the one rebuild path, snapshots and time travel.

Live actors, the client and the operator tools all rebuild through :func:`rebuild`, so a
replay folds exactly what the live actor folded.
"""

from __future__ import annotations

from typing import TypeVar

import msgpack

from engine.events.log import EventLog
from engine.events.log_base import gc_paused
from engine.projections.base import Folded, Projection, Snapshottable, fold, start
from engine.projections.placement import PoolProjection, PoolState

__all__ = ["gc_paused", "load_snapshot", "pool_at", "rebuild", "save_snapshot"]

S = TypeVar("S")


async def rebuild(
    log: EventLog,
    stream: str,
    projection: Projection[S],
    *,
    since: Folded[S] | None = None,
    until: str | None = None,
) -> Folded[S]:
    """Fold ``stream`` from the start (or from the snapshot ``since``) up to ``until``,
    the cyclic collector paused (``gc_paused``) while the large acyclic state is built."""
    folded = since if since is not None else start(projection)
    envelopes = await log.read_all(stream, after=folded.position)
    with gc_paused():
        return fold(projection, folded, envelopes, until=until)


async def save_snapshot(log: EventLog, projection: Snapshottable[S], folded: Folded[S]) -> None:
    """Store ``folded`` under the projection's name (msgpack: position and dumped state)."""
    data = msgpack.packb(
        {"position": folded.position, "state": projection.dump(folded.state)}, use_bin_type=True
    )
    await log.write_snapshot(projection.name, data)


async def load_snapshot(log: EventLog, projection: Snapshottable[S]) -> Folded[S] | None:
    """The snapshot :func:`save_snapshot` stored for the projection, or None."""
    raw = await log.read_snapshot(projection.name)
    if raw is None:
        return None
    obj = msgpack.unpackb(raw, raw=False)
    return Folded(projection.load(obj["state"]), str(obj["position"]))


async def pool_at(log: EventLog, *, until: str | None = None) -> Folded[PoolState]:
    """The pool right after event ``until`` of ``rl:pool`` (None: now): from the pool's
    snapshot when it is older, else from the stream's start (as far back as retention
    kept it)."""
    projection = PoolProjection()
    snapshot = await load_snapshot(log, projection)
    if snapshot is not None and (until is None or not snapshot.covers(until)):
        return await rebuild(log, log.names.pool, projection, since=snapshot, until=until)
    return await rebuild(log, log.names.pool, projection, until=until)
