"""Where the training data source stands, folded from ``rl:data``.

``rl:data`` holds one ``DataCursorAdvanced`` per planned rollout, appended atomically with the
rollout's plan. The fold keeps the latest training cursor per dataset set (eval rollouts never
move one), the first event of every rollout (a rollout present has been planned; later events
for it are duplicates), and the carried tails no later rollout has taken over. A cursor that does
not validate is skipped (the rollout still counts as planned), so a bad entry cannot crash a
scheduler's fold.

The projection is snapshottable (``dump`` / ``load``): a reader starts from the stored
snapshot and folds the tail, so retention trims ``rl:data`` below it. A snapshot keeps the
tails no rollout has taken over (a taken tail is never asked for again).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from engine.data_source import DataCursor
from engine.events.base import Envelope
from engine.events.catalog import DataCursorAdvanced, RolloutKind, TailCarried
from engine.events.codec import decode, encode

__all__ = ["DataCursorProjection", "DataState"]


@dataclass(slots=True)
class DataState:
    cursors: dict[tuple[str, ...], DataCursor] = field(default_factory=dict)
    rollouts: dict[str, DataCursorAdvanced] = field(default_factory=dict)
    # Carried tails by the rollout they come from, in log order, and the rollouts whose tail
    # a later rollout took over (its ``DataCursorAdvanced.carried``).
    tails: dict[str, TailCarried] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)

    def cursor_for(self, datasets: tuple[str, ...]) -> DataCursor | None:
        return self.cursors.get(datasets)

    def carried_for(self, request_stream: str) -> list[TailCarried]:
        """The carried tails of ``request_stream`` no rollout has taken over, oldest first."""
        return [
            t for t in self.tails.values()
            if t.request_stream == request_stream and t.rollout_id not in self.taken
        ]

    def copy(self) -> DataState:
        return DataState(
            cursors=dict(self.cursors),
            rollouts=dict(self.rollouts),
            tails=dict(self.tails),
            taken=set(self.taken),
        )


class DataCursorProjection:
    """Folds ``rl:data`` into a :class:`DataState`."""

    name = "data"

    def initial(self) -> DataState:
        return DataState()

    def dump(self, state: DataState) -> dict[str, Any]:
        return {
            "cursors": [c.model_dump(mode="json") for c in state.cursors.values()],
            "rollouts": [encode(ev) for ev in state.rollouts.values()],
            "tails": [encode(t) for t in state.tails.values() if t.rollout_id not in state.taken],
            "taken": sorted(state.taken),
        }

    def load(self, data: Any) -> DataState:
        cursors = [DataCursor.model_validate(c) for c in data["cursors"]]
        rollouts = [decode(raw) for raw in data["rollouts"]]
        tails = [decode(raw) for raw in data["tails"]]
        return DataState(
            cursors={c.datasets: c for c in cursors},
            rollouts={ev.rollout_id: ev for ev in rollouts if isinstance(ev, DataCursorAdvanced)},
            tails={t.rollout_id: t for t in tails if isinstance(t, TailCarried)},
            taken=set(data["taken"]),
        )

    def evolve(self, state: DataState, env: Envelope) -> DataState:
        ev = env.event
        if isinstance(ev, TailCarried):
            state.tails.setdefault(ev.rollout_id, ev)
            return state
        if not isinstance(ev, DataCursorAdvanced) or ev.rollout_id in state.rollouts:
            return state
        state.rollouts[ev.rollout_id] = ev
        state.taken.update(ev.carried)
        if ev.kind is RolloutKind.TRAIN:
            try:
                cursor = DataCursor.model_validate(ev.cursor)
            except ValidationError:
                return state
            state.cursors[cursor.datasets] = cursor
        return state
