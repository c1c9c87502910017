"""Events of ``rl:data`` (the data source's cursor, carried tails) and of ``rl:dead``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.events.base import Event
from engine.events.catalog.plan import TaskFetched
from engine.events.catalog.records import JSON, RolloutKind


class DataCursorAdvanced(Event):
    """The data source's position after a rollout's fetch, for exact resume. ``carried``:
    the rollouts whose carried tails (``TailCarried``) this rollout took over."""

    type: Literal["DataCursorAdvanced"] = "DataCursorAdvanced"
    rollout_id: str
    kind: RolloutKind = RolloutKind.TRAIN
    cursor: dict[str, JSON]
    previous: dict[str, JSON] = Field(default_factory=dict)
    carried: list[str] = Field(default_factory=list)


class TailCarried(Event):
    """An over-provisioned rollout became ready with ``tail="carry"``: its tail groups keep
    running, and the next request of ``request_stream`` takes them over (appended to
    ``rl:data`` with the ``RolloutReady``). ``tasks``: the tail's ``TaskFetched``, in index
    order."""

    type: Literal["TailCarried"] = "TailCarried"
    rollout_id: str
    request_stream: str
    tasks: list[TaskFetched]


class DeadLetter(Event):
    """An entry no reader could use, kept with its raw bytes and the reason."""

    type: Literal["DeadLetter"] = "DeadLetter"
    source_stream: str
    source_id: str
    raw: bytes = b""
    error: str
    group: str | None = None
    deliveries: int = 0
