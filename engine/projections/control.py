"""The projection of ``rl:control``: the policy's versions, the weight sync, rollout outcomes.

Every process folds the stream once (a :class:`~engine.runtime.follower.Follower` of this
projection). The weight sync is a saga on the stream (``engine/actors/weight_sync.py``)::

    PolicyVersionPublished(v) -> QuiesceRequested(v) -> WorkerParked(v, w)... ->
    QuiesceCompleted(v) -> PolicyVersionActivated(v) | WeightSyncFailed(v)

The state keeps:

* ``published``: the highest version any ``PolicyVersionPublished`` named (the trainer's
  current version), every version published, and the last publication itself;
* ``quiesce``: the open sync (a ``QuiesceRequested`` not yet ended by an activation or a
  failure) with the workers parked for it and its ``QuiesceCompleted`` once written;
* ``activated``: the last ``PolicyVersionActivated``;
* ``failure``: the last ``WeightSyncFailed`` when no activation came after it -- the engine is
  *poisoned*: nothing generates until a later sync succeeds;
* ``tails``: per rollout that became ready with a tail (an over-provisioned rollout), the
  tail's sample ids and what the request said to do with them (``abort`` / ``carry``), so a
  worker can abort the tail samples it still runs; the most recent ``keep_tails`` only;
* ``outcomes``: per rollout, the entry id of its first ``RolloutReady`` or ``RolloutFailed``
  (what the trainer's ``wait_ready`` reads back); the most recent ``keep_outcomes`` only;
* ``unconsumed``: the training rollouts with a staleness bound the trainer has not stepped
  on yet, in request order, each with whether it is ready. A rollout leaves on its
  ``RolloutFailed``, or when a new version is published after it became ready (the oldest
  ready one: a trainer steps on rollouts in order and publishes once a step). The
  ``pace`` staleness policy reads it (``rollouts_ahead``).

Generation may run only when no sync is open and the engine is not poisoned
(``generation_stopped``). The fold also keeps each policy server's last word from any worker
(``servers``: ``ServerUp`` / ``ServerDown`` / ``ServerStale``, ``engine.events.catalog.servers``):
while every server it knows of is down or stale, nothing may be admitted (``may_generate``),
and a worker starts from it. ``registered`` is the servers ``rollout serve`` registered
(``ServerRegistered`` / ``ServerRetired``, ``engine/events/catalog/servers.py``): endpoint -> its
last registration, in the order first registered; a retired server leaves it, and its health
word with it. The state is a frozen value; ``evolve`` returns a new one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from engine.events.base import Envelope
from engine.events.catalog import (
    PolicyVersionActivated,
    PolicyVersionPublished,
    QuiesceCompleted,
    QuiesceRequested,
    RolloutFailed,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
    WeightSyncFailed,
    WorkerParked,
)
from engine.events.catalog.servers import (
    ServerDown,
    ServerRegistered,
    ServerRetired,
    ServerRole,
    ServerStale,
    ServerUp,
)

__all__ = ["ControlProjection", "ControlState"]

Tail = tuple[str, frozenset[str]]
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class ControlState:
    published: int | None = None
    published_versions: frozenset[int] = frozenset()
    last_published: PolicyVersionPublished | None = None
    last_published_id: str | None = None
    quiesce: QuiesceRequested | None = None
    quiesce_id: str | None = None
    parked: frozenset[str] = frozenset()
    quiesce_done: QuiesceCompleted | None = None
    activated: PolicyVersionActivated | None = None
    activated_id: str | None = None
    failure: WeightSyncFailed | None = None
    failure_id: str | None = None
    tails: Mapping[str, Tail] = field(default_factory=dict)
    outcomes: Mapping[str, str] = field(default_factory=dict)
    servers: Mapping[str, str] = field(default_factory=dict)  # endpoint -> up / down / stale
    registered: Mapping[str, ServerRegistered] = field(default_factory=dict)
    unconsumed: tuple[tuple[str, bool], ...] = ()  # (rollout id, ready), request order

    @property
    def active_version(self) -> int | None:
        return None if self.activated is None else self.activated.version

    @property
    def poisoned(self) -> bool:
        return self.failure is not None

    @property
    def generation_stopped(self) -> bool:
        """A sync is open or the last one failed: no generate call may start."""
        return self.quiesce is not None or self.failure is not None

    def needs_sync(self, version: int) -> bool:
        """Whether work asking for ``version`` must wait for a sync: that version has been
        published and nothing at least as new is active yet. A version nobody published (a
        trainer that does not use the weight sync, or the initial weights) never waits."""
        if version not in self.published_versions:
            return False
        return self.active_version is None or self.active_version < version

    def registered_servers(self, role: ServerRole = "policy") -> tuple[str, ...]:
        """The endpoints registered for ``role``, in registration order."""
        return tuple(url for url, reg in self.registered.items() if reg.role == role)

    @property
    def servers_down(self) -> bool:
        """Every policy server the log has heard of is down or stale (none heard of: no)."""
        return bool(self.servers) and "up" not in self.servers.values()

    def may_generate(self, version: int = 0) -> bool:
        """No sync open, not poisoned, ``version`` needs no sync, and a server is up."""
        return (
            not self.generation_stopped and not self.needs_sync(version) and not self.servers_down
        )

    def why_stopped(self) -> str:
        if self.quiesce is not None:
            return f"weight sync to version {self.quiesce.version} in progress"
        if self.failure is not None:
            return f"weight sync to version {self.failure.version} failed: {self.failure.error}"
        if self.servers_down:
            return "every policy server is down: " + ", ".join(
                f"{url} ({state})" for url, state in sorted(self.servers.items())
            )
        return ""

    def current_version(self, requested: int = 0) -> int:
        """The trainer's current version: the highest published one, or ``requested`` when
        higher."""
        return max(requested, self.published if self.published is not None else requested)

    def rollouts_ahead(self, rollout_id: str) -> int:
        """Bounded training rollouts requested before ``rollout_id`` that the trainer has
        not stepped on yet (ready or not); 0 for a rollout the fold does not hold."""
        for at, (rid, _) in enumerate(self.unconsumed):
            if rid == rollout_id:
                return at
        return 0

    def tail_of(self, rollout_id: str) -> Tail | None:
        """``(mode, sample ids)`` of a ready rollout's tail; None: not ready with one."""
        return self.tails.get(rollout_id)

_SAID = {"ServerUp": "up", "ServerDown": "down", "ServerStale": "stale"}


def _kept(items: Mapping[str, V], key: str, value: V, keep: int) -> dict[str, V]:
    """``items`` with ``key: value`` added, the oldest dropped past ``keep``."""
    out = {**items, key: value}
    for old in list(out)[: max(0, len(out) - keep)]:
        del out[old]
    return out


def _settled(
    unconsumed: tuple[tuple[str, bool], ...], ev: RolloutReady | RolloutFailed
) -> tuple[tuple[str, bool], ...]:
    """A ready rollout is marked so; a failed one leaves (no step comes of it)."""
    if isinstance(ev, RolloutFailed):
        return tuple(e for e in unconsumed if e[0] != ev.rollout_id)
    return tuple((rid, ready or rid == ev.rollout_id) for rid, ready in unconsumed)


def _consumed(unconsumed: tuple[tuple[str, bool], ...]) -> tuple[tuple[str, bool], ...]:
    """Without the oldest ready rollout: the trainer's step on it made the new version."""
    for at, (_, ready) in enumerate(unconsumed):
        if ready:
            return unconsumed[:at] + unconsumed[at + 1 :]
    return unconsumed


class ControlProjection:
    """Folds ``rl:control`` into a :class:`ControlState` (other events pass)."""

    name = "control"

    def __init__(self, *, keep_tails: int = 256, keep_outcomes: int = 4096) -> None:
        self._keep_tails = keep_tails
        self._keep_outcomes = keep_outcomes

    def initial(self) -> ControlState:
        return ControlState()

    def evolve(self, state: ControlState, env: Envelope) -> ControlState:
        ev = env.event
        replace = dataclasses.replace
        if isinstance(ev, RolloutRequested):
            if ev.max_staleness is None or ev.kind is not RolloutKind.TRAIN:
                return state
            if ev.rollout_id in state.outcomes or any(
                rid == ev.rollout_id for rid, _ in state.unconsumed
            ):
                return state
            unconsumed = (*state.unconsumed, (ev.rollout_id, False))
            return replace(state, unconsumed=unconsumed[-self._keep_outcomes :])
        if isinstance(ev, (RolloutReady, RolloutFailed)):
            if ev.rollout_id in state.outcomes:
                return state
            state = replace(state, unconsumed=_settled(state.unconsumed, ev))
            outcomes = _kept(state.outcomes, ev.rollout_id, env.id, self._keep_outcomes)
            tails = state.tails
            if isinstance(ev, RolloutReady) and ev.tail_sample_ids:
                mode = "carry" if ev.tail_carried else "abort"
                tail = (mode, frozenset(ev.tail_sample_ids))
                tails = _kept(tails, ev.rollout_id, tail, self._keep_tails)
            return replace(state, outcomes=outcomes, tails=tails)
        if isinstance(ev, PolicyVersionPublished):
            top = ev.version if state.published is None else max(state.published, ev.version)
            unconsumed = state.unconsumed
            if state.published is None or top > state.published:
                unconsumed = _consumed(unconsumed)
            return replace(
                state, published=top, unconsumed=unconsumed,
                published_versions=state.published_versions | {ev.version},
                last_published=ev, last_published_id=env.id,
            )
        if isinstance(ev, QuiesceRequested):
            return replace(
                state, quiesce=ev, quiesce_id=env.id, parked=frozenset(), quiesce_done=None
            )
        if isinstance(ev, WorkerParked):
            if state.quiesce is None or state.quiesce.version != ev.version:
                return state
            return replace(state, parked=state.parked | {ev.worker})
        if isinstance(ev, QuiesceCompleted):
            if state.quiesce is None or state.quiesce.version != ev.version:
                return state
            return replace(state, quiesce_done=ev)
        if isinstance(ev, PolicyVersionActivated):
            return replace(
                state, activated=ev, activated_id=env.id, failure=None, failure_id=None,
                quiesce=None, quiesce_id=None, parked=frozenset(), quiesce_done=None,
            )
        if isinstance(ev, ServerUp | ServerDown | ServerStale):
            said = _SAID[ev.type]
            if state.servers.get(ev.endpoint) == said:
                return state
            return replace(state, servers={**state.servers, ev.endpoint: said})
        if isinstance(ev, ServerRegistered):
            return replace(state, registered={**state.registered, ev.endpoint: ev})
        if isinstance(ev, ServerRetired):
            if ev.endpoint not in state.registered and ev.endpoint not in state.servers:
                return state
            return replace(
                state,
                registered={k: v for k, v in state.registered.items() if k != ev.endpoint},
                servers={k: v for k, v in state.servers.items() if k != ev.endpoint},
            )
        if isinstance(ev, WeightSyncFailed):
            return replace(
                state, failure=ev, failure_id=env.id,
                quiesce=None, quiesce_id=None, parked=frozenset(), quiesce_done=None,
            )
        return state
