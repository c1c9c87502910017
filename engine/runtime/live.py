"""A projection kept current from the tail of one stream, for compare-and-append writers.

``LiveFold.position`` is what a writer passes as ``expected_last``. After an
``AppendConflict`` the writer calls ``refresh(at_least=conflict.current)``: everything up to
that id has then been read, so the position moves there even when the last entries were
dead-lettered (undecodable entries never reach the fold, and without this the writer would
conflict on them forever).

A projection that is ``Snapshottable`` (the placement pool) starts from its stored snapshot,
when there is one, and folds only the tail after it: its stream may be trimmed below the
snapshot (``engine.ops.retention``). A fold whose position was trimmed away meanwhile (a
worker that had not looked at the pool for a retention interval) finds no entry at or below
its position and starts again from the newer snapshot, which covers what was trimmed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from engine.events.base import Envelope
from engine.events.ids import EMPTY_ID, later_id, parse_id
from engine.events.log import EventLog
from engine.projections.base import Folded, Projection, Snapshottable, fold, start
from engine.runtime.rebuild import load_snapshot

__all__ = ["LiveFold", "later_id"]

S = TypeVar("S")


class LiveFold(Generic[S]):
    """``owner``: this fold's actor owns the stream, so it dead-letters entries that do not
    decode (once each); any other fold skips them and writes nothing."""

    def __init__(
        self, log: EventLog, stream: str, projection: Projection[S], *, owner: bool = False
    ) -> None:
        self.log = log
        self.stream = stream
        self.projection = projection
        self.owner = owner
        self.folded: Folded[S] = start(projection)

    @property
    def state(self) -> S:
        return self.folded.state

    @property
    def position(self) -> str:
        return self.folded.position

    def apply(self, envelopes: Iterable[Envelope], *, at_least: str | None = None) -> bool:
        """Fold ``envelopes``; returns whether the position moved."""
        before = self.folded.position
        folded = fold(self.projection, self.folded, envelopes)
        if at_least is not None:
            folded = Folded(folded.state, later_id(folded.position, at_least))
        self.folded = folded
        return folded.position != before

    async def _trimmed_past(self) -> bool:
        """Whether the stream no longer holds this fold's position (nor anything before)."""
        first = await self.log.first_id(self.stream)
        return first == EMPTY_ID or parse_id(first) > parse_id(self.folded.position)

    async def refresh(self, *, at_least: str | None = None) -> bool:
        """Fold the stream's tail past the position; returns whether the position moved."""
        if isinstance(self.projection, Snapshottable) and (
            self.folded.position == EMPTY_ID or await self._trimmed_past()
        ):
            snapshot = await load_snapshot(self.log, self.projection)
            if snapshot is not None and not self.folded.covers(snapshot.position):
                self.folded = snapshot
        tail = await self.log.read_all(
            self.stream, after=self.position, dead_letter=self.owner
        )
        return self.apply(tail, at_least=at_least)
