"""Projection fold / rebuild / snapshot contract."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.events import Envelope, EventLog, RolloutFailed
from engine.projections.base import Folded, fold, start
from engine.runtime.rebuild import load_snapshot, rebuild, save_snapshot

S = "rl:proj"


@dataclass(frozen=True)
class Reasons:
    """Counts reasons; ignores a duplicate (rollout_id) — domain-level idempotence."""

    name: str = "reasons"

    def initial(self) -> tuple[tuple[str, str], ...]:
        return ()

    def evolve(
        self, state: tuple[tuple[str, str], ...], env: Envelope
    ) -> tuple[tuple[str, str], ...]:
        ev = env.event
        if not isinstance(ev, RolloutFailed) or any(r == ev.rollout_id for r, _ in state):
            return state
        return (*state, (ev.rollout_id, ev.reason))

    def dump(self, state: tuple[tuple[str, str], ...]) -> Any:
        return [list(x) for x in state]

    def load(self, data: Any) -> tuple[tuple[str, str], ...]:
        return tuple((a, b) for a, b in data)


async def test_rebuild_equals_incremental_fold_and_is_idempotent(log: EventLog) -> None:
    ids = await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason=str(i)))
                                 for i in range(10)])
    p = Reasons()
    full = await rebuild(log, S, p)
    assert full.position == ids[-1]
    assert [r for r, _ in full.state] == [f"r{i}" for i in range(10)]
    envs = await log.read(S)
    halves = fold(p, fold(p, start(p), envs[:4]), envs)  # redelivered prefix is skipped
    assert halves == full
    assert fold(p, full, envs) is not None and fold(p, full, envs).state == full.state


async def test_time_travel_until(log: EventLog) -> None:
    ids = await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason="x"))
                                 for i in range(5)])
    past = await rebuild(log, S, Reasons(), until=ids[2])
    assert past.position == ids[2] and len(past.state) == 3


async def test_snapshot_plus_tail_equals_full_rebuild(log: EventLog) -> None:
    p = Reasons()
    await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason="a")) for i in range(6)])
    snap = await rebuild(log, S, p)
    await save_snapshot(log, p, snap)
    await log.append_many([(S, RolloutFailed(rollout_id=f"r{i}", reason="b"))
                           for i in range(4, 9)])
    loaded = await load_snapshot(log, p)
    assert isinstance(loaded, Folded) and loaded == snap
    assert await rebuild(log, S, p, since=loaded) == await rebuild(log, S, p)
