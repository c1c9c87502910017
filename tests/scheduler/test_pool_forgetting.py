"""The pool forgets the batches of closed rollouts, and that changes no decision.

A property test (Hypothesis) plays the pool's protocol with random moves: admissions decided
on the folded state (as the scheduler does), full and partial releases, releases and leases
of stale holders, duplicate acquisitions, re-declarations of the layout, and
``AdmissionClosed`` after a rollout's last admission. The same events are folded twice: as
written, and without the ``AdmissionClosed`` events (the pool as it was before it could
forget). After every event:

* the pool never over-allocates;
* both folds hold the same tokens on the same nodes, so every admission decision (for any
  batch still to admit) is the same;
* a batch either fold calls acquired is acquired in the forgetting one too (a closed rollout
  answers "acquired" for all its batches, so a resumed request admits nothing);
* the forgetting fold remembers only batches of open rollouts and batches holding tokens;
* a snapshot (``PoolProjection.dump`` / ``load``, through msgpack) restores the same pool.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.domain import Resource
from engine.events import (
    AdmissionClosed,
    BatchLeased,
    Envelope,
    Event,
    NodeDecl,
    PoolDeclared,
    TokenAcquired,
    TokenReleased,
)
from engine.events.redis_log import RedisEventLog
from engine.ops.retention import retention_pass
from engine.projections.placement import (
    PoolProjection,
    PoolState,
    try_acquire_batch,
)
from engine.runtime.follower import Follower
from engine.runtime.rebuild import pool_at

ROLLOUTS = ("r0", "r1", "r2")
BATCHES = ("b0", "b1", "b2")
BUDGET = Resource(gpu=2, cpu=8, memory_gb=16, concurrency=3)
PER_SAMPLE = [
    Resource(gpu=0.5, cpu=1, memory_gb=2),
    Resource(gpu=1, cpu=2, memory_gb=1),
    Resource(gpu=0, cpu=3, memory_gb=4),
]
NODES = [
    [NodeDecl(node="n0", gpus=[0, 1], cpu=8, memory_gb=16)],
    [NodeDecl(node="n0", gpus=[0], cpu=6, memory_gb=8),
     NodeDecl(node="n1", gpus=[0, 1, 2], cpu=4, memory_gb=32)],
]


def _usage(state: PoolState) -> dict[str, tuple[float, float, dict[int, float], int]]:
    return {
        name: (node.cpu_used, node.memory_used, dict(node.gpu_used), node.holders)
        for name, node in state.nodes.items()
    }


def _close(a: dict[str, tuple[float, float, dict[int, float], int]],
           b: dict[str, tuple[float, float, dict[int, float], int]]) -> bool:
    if a.keys() != b.keys():
        return False
    for name in a:
        (ca, ma, ga, ha), (cb, mb, gb, hb) = a[name], b[name]
        if ha != hb or ga.keys() != gb.keys():
            return False
        if not all(math.isclose(x, y, abs_tol=1e-9) for x, y in
                   [(ca, cb), (ma, mb), *((ga[g], gb[g]) for g in ga)]):
            return False
    return True


def _decision(state: PoolState, per_sample: Resource, key: tuple[str, str]) -> object:
    grants = try_acquire_batch(state, BUDGET, per_sample, 3, token_prefix=key[1])
    return None if grants is None else [g.model_dump() for g in grants]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_forgetting_closed_rollouts_never_changes_a_live_decision(data: st.DataObject) -> None:
    projection = PoolProjection()
    forgetting, reference = projection.initial(), projection.initial()
    position = 0
    n_batches = {rid: data.draw(st.integers(1, len(BATCHES)), label=f"batches of {rid}")
                 for rid in ROLLOUTS}
    per_sample = {rid: data.draw(st.sampled_from(PER_SAMPLE)) for rid in ROLLOUTS}
    closed: set[str] = set()
    admitted: set[tuple[str, str]] = set()

    def apply(ev: Event) -> None:
        nonlocal forgetting, reference, position
        position += 1
        env = Envelope("rl:{rl}:pool", f"{position}-0", ev)
        forgetting = projection.evolve(forgetting, env)
        if not isinstance(ev, AdmissionClosed):
            reference = projection.evolve(reference, env)

    declaration = PoolDeclared(nodes=data.draw(st.sampled_from(NODES)))
    apply(declaration)
    for _ in range(data.draw(st.integers(5, 40), label="moves")):
        rid = data.draw(st.sampled_from(ROLLOUTS))
        bid = data.draw(st.sampled_from(BATCHES[: n_batches[rid]]))
        key = (rid, bid)
        move = data.draw(st.sampled_from(
            ["admit", "admit", "release", "release_some", "lease", "stale_release",
             "duplicate", "duplicate", "close", "close", "redeclare"]))
        if move == "admit" and rid not in closed and key not in admitted:
            grants = try_acquire_batch(forgetting, BUDGET, per_sample[rid], 3,
                                       token_prefix=bid)
            if grants is not None:
                admitted.add(key)
                apply(TokenAcquired(rollout_id=rid, batch_id=bid, evaluator_id="e",
                                    tokens=grants))
        elif move == "duplicate" and key in admitted:
            grants = try_acquire_batch(reference, BUDGET, per_sample[rid], 3,
                                       token_prefix=bid)
            if grants is not None:  # a redelivered acquisition: both folds ignore it
                apply(TokenAcquired(rollout_id=rid, batch_id=bid, evaluator_id="e",
                                    tokens=grants))
        elif move in ("release", "release_some", "stale_release"):
            held = sorted(reference.held.get(key, {}))
            some = data.draw(st.lists(st.sampled_from(held), unique=True)) if held else []
            lease = reference.leases.get(key, 0)
            apply(TokenReleased(
                rollout_id=rid, batch_id=bid,
                token_ids=None if move == "release" else some,
                lease=max(0, lease - 1) if move == "stale_release" else lease,
            ))
        elif move == "lease":
            apply(BatchLeased(rollout_id=rid, batch_id=bid,
                              lease=data.draw(st.integers(1, 4))))
        elif move == "close" and all((rid, b) in admitted for b in BATCHES[: n_batches[rid]]):
            closed.add(rid)
            apply(AdmissionClosed(rollout_id=rid))
        elif move == "redeclare":  # a restarted scheduler (a smaller layout would over-allocate)
            apply(declaration)

        assert forgetting.over_allocation() == []
        assert forgetting.held == reference.held
        assert _close(_usage(forgetting), _usage(reference))
        assert forgetting.fenced == reference.fenced
        for r in ROLLOUTS:
            for b in BATCHES[: n_batches[r]]:
                if reference.has_acquired(r, b):
                    assert forgetting.has_acquired(r, b)
                if r not in closed:
                    assert forgetting.has_acquired(r, b) == reference.has_acquired(r, b)
                    if (r, b) not in admitted:
                        assert (_decision(forgetting, per_sample[r], (r, b))
                                == _decision(reference, per_sample[r], (r, b)))
                else:
                    assert forgetting.has_acquired(r, b)
        assert all(r not in closed or k in forgetting.held for k in forgetting.acquired
                   for r in [k[0]])
        assert all(r not in closed or k in forgetting.held for k in forgetting.leases
                   for r in [k[0]])

        again = projection.load(msgpack.unpackb(msgpack.packb(projection.dump(forgetting))))
        assert again.held == forgetting.held
        assert again.acquired == forgetting.acquired and again.closed == forgetting.closed
        assert again.leases == forgetting.leases and again.declared == forgetting.declared
        assert _close(_usage(again), _usage(forgetting))


def test_a_closed_rollouts_record_is_gone_once_its_tokens_are_back() -> None:
    projection = PoolProjection()
    state = projection.initial()
    events: list[Event] = [PoolDeclared(nodes=NODES[0])]
    for i in range(50):
        grants = try_acquire_batch(state, BUDGET, PER_SAMPLE[0], 3, token_prefix=f"b{i}")
        assert grants is not None
        events = [TokenAcquired(rollout_id=f"r{i}", batch_id=f"b{i}", evaluator_id="e",
                                tokens=grants),
                  AdmissionClosed(rollout_id=f"r{i}"),
                  TokenReleased(rollout_id=f"r{i}", batch_id=f"b{i}", token_ids=None)]
        if i == 0:
            events.insert(0, PoolDeclared(nodes=NODES[0]))
        for j, ev in enumerate(events):
            state = projection.evolve(state, Envelope("p", f"{i + 1}-{j}", ev))
        assert state.acquired == set() and state.held == {}
    assert state.has_acquired("r7", "b7") and state.is_full_capacity()
    assert len(msgpack.packb(projection.dump(state))) < 1000


# ---------------------------------------------------------------- snapshot + trim on a log


async def _cycle(log: RedisEventLog, i: int) -> None:
    """One rollout through the pool: acquire its batch, close admission, release."""
    state = (await pool_at(log)).state
    grants = try_acquire_batch(state, BUDGET, PER_SAMPLE[0], 2, token_prefix=f"b{i}")
    assert grants is not None
    await log.append_many([
        (log.names.pool, TokenAcquired(rollout_id=f"r{i}", batch_id=f"b{i}", evaluator_id="e",
                                       tokens=grants)),
        (log.names.pool, AdmissionClosed(rollout_id=f"r{i}")),
        (log.names.pool, TokenReleased(rollout_id=f"r{i}", batch_id=f"b{i}", token_ids=None)),
    ])


async def test_retention_trims_the_pool_below_its_snapshot_and_readers_start_there(
    log: RedisEventLog, tmp_path: Path
) -> None:
    names = log.names
    await log.append(names.pool, PoolDeclared(nodes=NODES[1]))
    stale = Follower(log, names.pool, PoolProjection())  # a worker that looks now and then
    await stale.refresh()
    held = try_acquire_batch((await pool_at(log)).state, BUDGET, PER_SAMPLE[1], 2,
                             token_prefix="live")
    assert held is not None  # a batch of an open rollout keeps its tokens throughout
    await log.append(names.pool, TokenAcquired(rollout_id="open", batch_id="live",
                                               evaluator_id="e", tokens=held))
    lengths = []
    for i in range(12):
        await _cycle(log, i)
        # A second ahead: what was appended this millisecond is past the window too.
        report = await retention_pass(log, tmp_path / "store", keep_s=0, now_s=time.time() + 1)
        lengths.append(await log.stream_length(names.pool))
        if i == 0:
            assert names.pool not in report.trimmed or report.trimmed[names.pool] == 0
    # Each pass trims what the pass before it snapshotted: the stream stays short.
    assert max(lengths[2:]) <= 3 + 3, lengths
    assert await log.read_snapshot("pool") is not None
    # Nothing was lost: a fresh fold (snapshot + tail), the time-travel tool, and a fold
    # whose position was trimmed away meanwhile all see the same pool.
    fresh = Follower(log, names.pool, PoolProjection())
    await fresh.refresh()
    await stale.refresh()
    now = (await pool_at(log)).state
    for state in (fresh.state, stale.state, now):
        assert state.declared is not None and state.declared.nodes == NODES[1]
        assert set(state.held) == {("open", "live")}
        assert state.acquired == {("open", "live")}
        assert state.closed == {f"r{i}" for i in range(12)}
        assert state.has_acquired("r3", "b3") and not state.has_acquired("open", "other")
        assert state.over_allocation() == []
    assert stale.position == fresh.position
