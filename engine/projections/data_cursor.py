"""Where the training data source stands, folded from ``rl:data``.

``rl:data`` holds one ``DataCursorAdvanced`` per planned rollout, appended atomically with the
rollout's plan. The fold keeps the latest training cursor per dataset set (eval rollouts never
move one), the first event of every rollout (a rollout present has been planned; later events
for it are duplicates), and the carried tails no later rollout has taken over. A cursor that does
not validate is skipped (the rollout still counts as planned), so a bad entry cannot crash a
scheduler's fold.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import ValidationError

from engine.data_source import DataCursor
from engine.events.base import Envelope
from engine.events.catalog import DataCursorAdvanced, RolloutKind, TailCarried

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
