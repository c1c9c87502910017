"""The placement pool as a pure projection, and its pure allocation functions."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from engine.actors.admission import decide_admission
from engine.config.evaluators import load_evaluators
from engine.domain import EvaluatorProfile, Resource
from engine.errors import PlacementError
from engine.events import (
    BatchAdmitted,
    BatchSealed,
    Envelope,
    Event,
    NodeDecl,
    PoolDeclared,
    TokenAcquired,
    TokenGrant,
    TokenReleased,
)
from engine.events.redis_log import RedisEventLog
from engine.projections.placement import (
    UNBOUNDED,
    PoolState,
    budget_tokens,
    fold_all,
    max_tokens_for,
    pool_of,
    try_acquire_batch,
)
from tests.conftest import ClientFactory
from tests.rig import Engine
from tests.scheduler.helpers import (
    FIXTURES,
    fresh_client_log,
    layout,
    load_specs,
    make_scheduler,
    request,
    running,
    write_config,
)

BIG = Resource(gpu=64, cpu=1024, memory_gb=4096, concurrency=64)


def fold(*events: Event) -> PoolState:
    return fold_all(Envelope("rl:pool", f"1-{i}", ev) for i, ev in enumerate(events))


def declared(*nodes: NodeDecl) -> PoolDeclared:
    return PoolDeclared(nodes=list(nodes))


def node(name: str, gpus: int = 0, cpu: float = 64, memory_gb: float = 256) -> NodeDecl:
    return NodeDecl(node=name, gpus=list(range(gpus)), cpu=cpu, memory_gb=memory_gb)


def acquired(batch: str, grants: list[TokenGrant], rollout: str = "r") -> TokenAcquired:
    return TokenAcquired(rollout_id=rollout, batch_id=batch, evaluator_id="e", tokens=grants)


def take(state: PoolState, per: Resource, n: int, batch: str, budget: Resource = BIG) -> PoolState:
    """Acquire and fold in place (the way the scheduler records a decision)."""
    grants = try_acquire_batch(state, budget, per, n, token_prefix=batch)
    assert grants is not None, f"{batch} did not fit"
    return fold_all_onto(state, acquired(batch, grants))


def fold_all_onto(state: PoolState, *events: Event) -> PoolState:
    from engine.projections.placement import PoolProjection

    projection = PoolProjection()
    for i, ev in enumerate(events):
        state = projection.evolve(state, Envelope("rl:pool", f"2-{i}", ev))
    return state


def shares(grants: list[TokenGrant]) -> list[tuple[str, list[tuple[int, float]]]]:
    return [(g.node, [(s.gpu, s.fraction) for s in g.gpus]) for g in grants]


# ---------------------------------------------------------------- fractional GPU


def test_fractional_gpu_packs_floor_one_over_fraction_per_gpu() -> None:
    state = pool_of(declared(node("a", gpus=2)))
    per = Resource(gpu=0.33)
    grants = try_acquire_batch(state, BIG, per, 6)
    assert grants is not None
    # Best fit fills one GPU before starting the next: three 0.33 shares per GPU.
    assert [s[1][0][0] for s in shares(grants)] == [0, 0, 0, 1, 1, 1]
    assert try_acquire_batch(state, BIG, per, 7) is None
    assert max_tokens_for(state, per) == 6


def test_best_fit_takes_the_gpu_with_the_least_room_that_still_fits() -> None:
    state = pool_of(declared(node("a", gpus=3)))
    # GPU 0 holds 0.75 (0.25 left), GPU 1 holds 0.5 (0.5 left), GPU 2 is free.
    state = fold_all_onto(
        state,
        acquired("x", [TokenGrant(token_id="x:0", node="a", gpus=[{"gpu": 0, "fraction": 0.75}])]),
        acquired("y", [TokenGrant(token_id="y:0", node="a", gpus=[{"gpu": 1, "fraction": 0.5}])]),
    )
    grants = try_acquire_batch(state, BIG, Resource(gpu=0.4), 1)
    assert grants is not None and shares(grants) == [("a", [(1, 0.4)])]
    grants = try_acquire_batch(state, BIG, Resource(gpu=0.25), 1)
    assert grants is not None and shares(grants) == [("a", [(0, 0.25)])]
    grants = try_acquire_batch(state, BIG, Resource(gpu=0.6), 1)
    assert grants is not None and shares(grants) == [("a", [(2, 0.6)])]


def test_whole_gpus_need_completely_free_gpus_on_one_node() -> None:
    state = pool_of(declared(node("a", gpus=3), node("b", gpus=2)))
    per = Resource(gpu=2)
    assert max_tokens_for(state, per) == 2  # floor(3/2) + floor(2/2)
    grants = try_acquire_batch(state, BIG, per, 2)
    assert grants is not None
    assert sorted(len(g.gpus) for g in grants) == [2, 2]
    assert {g.node for g in grants} == {"a", "b"}
    # Two 0.6 shares land on a (most free GPU), on GPUs 0 and 1 (0.6 does not fit beside
    # 0.6): a keeps one free GPU, too few for a 2-GPU token.
    state = take(state, Resource(gpu=0.6), 2, "frac")
    assert shares(list(state.held_by("r", "frac").values())) == [
        ("a", [(0, 0.6)]),
        ("a", [(1, 0.6)]),
    ]
    assert try_acquire_batch(state, BIG, per, 2) is None
    grants = try_acquire_batch(state, BIG, per, 1)
    assert grants is not None and grants[0].node == "b"


def test_gpu_zero_samples_gate_on_cpu_and_memory_only() -> None:
    state = pool_of(declared(node("cpu-only", gpus=0, cpu=8, memory_gb=64)))
    per = Resource(cpu=2, memory_gb=20)
    assert max_tokens_for(state, per) == 3  # memory binds: floor(64 / 20)
    grants = try_acquire_batch(state, BIG, per, 3)
    assert grants is not None and all(g.gpus == [] for g in grants)
    assert try_acquire_batch(state, BIG, per, 4) is None
    # A GPU sample cannot use a node without GPUs.
    assert try_acquire_batch(state, BIG, Resource(gpu=0.5), 1) is None
    assert max_tokens_for(state, Resource(gpu=0.5)) == 0


# ---------------------------------------------------------------- node choice, all-or-nothing


def test_greedy_from_the_node_with_most_free_gpu_across_nodes() -> None:
    state = pool_of(declared(node("a", gpus=2), node("b", gpus=4)))
    grants = try_acquire_batch(state, BIG, Resource(gpu=1), 5)
    assert grants is not None
    # Free GPUs a=2, b=4 -> b (4) -> b (3) -> tie at 2, layout order -> a -> b (2 vs 1)
    # -> tie at 1 -> a.
    assert [g.node for g in grants] == ["b", "b", "a", "b", "a"]
    assert [g.token_id for g in grants] == [f"batch:t{i}" for i in range(5)]
    six = try_acquire_batch(state, BIG, Resource(gpu=1), 6)
    assert six is not None and six == try_acquire_batch(state, BIG, Resource(gpu=1), 6)
    assert try_acquire_batch(state, BIG, Resource(gpu=1), 7) is None


def test_all_or_nothing_leaves_the_state_untouched() -> None:
    state = pool_of(declared(node("a", gpus=2, cpu=4), node("b", gpus=1, cpu=4)))
    state = take(state, Resource(gpu=0.5, cpu=1), 2, "first")
    before = state.copy()
    # Three more whole GPUs do not fit (only 2 completely free GPUs are left).
    assert try_acquire_batch(state, BIG, Resource(gpu=1, cpu=1), 3) is None
    assert state == before
    assert state.tokens_held == 2


def test_budget_caps_the_tokens_a_batch_takes() -> None:
    per = Resource(gpu=0.5, cpu=2, memory_gb=4)
    # gpu pays for 4, cpu for 3, memory for 10, concurrency for 8: three tokens.
    budget = Resource(gpu=2, cpu=6, memory_gb=40, concurrency=8)
    assert budget_tokens(budget, per) == 3
    assert budget_tokens(budget.model_copy(update={"concurrency": 2}), per) == 2
    state = pool_of(declared(node("a", gpus=8)))
    grants = try_acquire_batch(state, budget, per, 10)
    assert grants is not None and len(grants) == 3
    grants = try_acquire_batch(state, budget, per, 2)  # a small batch needs only its samples
    assert grants is not None and len(grants) == 2
    with pytest.raises(PlacementError, match="pays for no token"):
        try_acquire_batch(state, Resource(cpu=1), per, 1)


def test_max_tokens_for_takes_the_binding_dimension_per_node() -> None:
    state = pool_of(
        declared(node("a", gpus=4, cpu=6, memory_gb=100), node("b", gpus=1, cpu=64, memory_gb=8))
    )
    per = Resource(gpu=0.25, cpu=1, memory_gb=2)
    # a: gpu 16, cpu 6, memory 50 -> 6; b: gpu 4, cpu 64, memory 4 -> 4.
    assert max_tokens_for(state, per) == 10
    assert max_tokens_for(state, Resource()) == UNBOUNDED
    assert max_tokens_for(PoolState(), per) == UNBOUNDED


def test_random_batches_never_over_allocate_and_fill_to_capacity() -> None:
    rng = random.Random(7)
    state = pool_of(declared(node("a", gpus=4, cpu=32), node("b", gpus=2, cpu=16)))
    for i in range(300):
        per = Resource(
            gpu=rng.choice([0, 0.25, 0.33, 0.5, 1, 2]), cpu=rng.choice([0.5, 1, 2]),
            memory_gb=rng.choice([1, 4]),
        )
        grants = try_acquire_batch(state, BIG, per, rng.randint(1, 4), token_prefix=f"b{i}")
        if grants is not None:
            state = fold_all_onto(state, acquired(f"b{i}", grants))
        elif state.held and rng.random() < 0.7:
            rollout, batch = rng.choice(sorted(state.held))
            state = fold_all_onto(state, TokenReleased(rollout_id=rollout, batch_id=batch))
        assert state.over_allocation() == []
    for rollout, batch in sorted(state.held):
        state = fold_all_onto(state, TokenReleased(rollout_id=rollout, batch_id=batch))
    assert state.is_full_capacity()


def test_the_folds_node_order_stays_the_placement_preference_through_multi_node_batches() -> None:
    # The fold re-places a node once per event, after all of the event's tokens on it: the
    # order must still be exactly the nodes sorted by their keys, whatever the grants span.
    rng = random.Random(11)
    state = pool_of(
        declared(node("a", gpus=2, cpu=8), node("b", gpus=4, cpu=8), node("c", gpus=1, cpu=64))
    )
    for i in range(400):
        per = Resource(gpu=rng.choice([0, 0.5, 1]), cpu=rng.choice([0.5, 1]), memory_gb=1)
        grants = try_acquire_batch(state, BIG, per, rng.randint(1, 12), token_prefix=f"b{i}")
        if grants is not None:
            state = fold_all_onto(state, acquired(f"b{i}", grants))
        elif state.held:
            rollout, batch = rng.choice(sorted(state.held))
            held = sorted(state.held[(rollout, batch)])
            some = rng.sample(held, rng.randint(1, len(held)))  # a partial release too
            state = fold_all_onto(
                state, TokenReleased(rollout_id=rollout, batch_id=batch, token_ids=some)
            )
        assert state.order == sorted((n.key, name) for name, n in state.nodes.items())
        assert state.over_allocation() == []
    assert len({g.node for g in acquired_nodes(state)}) > 1  # batches did span nodes


def acquired_nodes(state: PoolState) -> list[TokenGrant]:
    return [
        held.grant(token) for tokens in state.held.values() for token, held in tokens.items()
    ]


# ---------------------------------------------------------------- the fold


def test_release_is_idempotent_and_ignores_unknown_tokens_and_batches() -> None:
    grants = [
        TokenGrant(token_id=f"b:t{i}", node="a", gpus=[{"gpu": 0, "fraction": 0.25}], cpu=1)
        for i in range(3)
    ]
    start = (declared(node("a", gpus=1, cpu=4)), acquired("b", grants))
    state = fold(*start, TokenReleased(rollout_id="r", batch_id="b", token_ids=["b:t0"]))
    assert set(state.held_by("r", "b")) == {"b:t1", "b:t2"}
    assert state.nodes["a"].gpu_used[0] == pytest.approx(0.5)
    again = fold(
        *start,
        TokenReleased(rollout_id="r", batch_id="b", token_ids=["b:t0"]),
        TokenReleased(rollout_id="r", batch_id="b", token_ids=["b:t0", "nope"]),
        TokenReleased(rollout_id="r", batch_id="other"),
        TokenReleased(rollout_id="other", batch_id="b"),
    )
    assert again.held == state.held and again.nodes == state.nodes
    # token_ids=None gives back whatever the batch still holds; repeating it changes nothing.
    done = fold(
        *start,
        TokenReleased(rollout_id="r", batch_id="b", token_ids=["b:t0"]),
        TokenReleased(rollout_id="r", batch_id="b"),
        TokenReleased(rollout_id="r", batch_id="b"),
    )
    assert done.is_full_capacity()
    assert done.has_acquired("r", "b")


def test_a_batch_acquires_at_most_once() -> None:
    grant = TokenGrant(token_id="b:t0", node="a", cpu=3)
    state = fold(
        declared(node("a", cpu=4)),
        acquired("b", [grant]),
        TokenReleased(rollout_id="r", batch_id="b"),
        acquired("b", [grant]),  # a duplicate, even after the release
    )
    assert state.is_full_capacity()
    assert state.has_acquired("r", "b")


def test_the_fold_records_over_allocation_instead_of_hiding_it() -> None:
    state = fold(
        declared(node("a", gpus=1, cpu=2)),
        acquired("x", [TokenGrant(token_id="x", node="a", gpus=[{"gpu": 0, "fraction": 0.75}])]),
        acquired("y", [TokenGrant(token_id="y", node="a", gpus=[{"gpu": 0, "fraction": 0.5}],
                                  cpu=3)]),
    )
    assert state.over_allocation() == [
        "node 'a': cpu 3 used of 2",
        "node 'a': gpu 0 1.25 used of 1",
    ]


def test_redeclaring_replaces_the_nodes_and_keeps_what_is_held() -> None:
    grant = TokenGrant(token_id="x", node="a", gpus=[{"gpu": 0, "fraction": 1.0}], cpu=2)
    state = fold(declared(node("a", gpus=2, cpu=8)), acquired("x", [grant]))
    state = fold_all_onto(state, declared(node("a", gpus=1, cpu=4), node("c", gpus=4)))
    assert list(state.nodes) == ["a", "c"]
    assert state.nodes["a"].gpu_used == {0: 1.0} and state.nodes["a"].cpu_used == 2
    assert try_acquire_batch(state, BIG, Resource(gpu=1), 5) is None
    assert try_acquire_batch(state, BIG, Resource(gpu=1), 4) is not None
    state = fold_all_onto(state, TokenReleased(rollout_id="r", batch_id="x"))
    assert state.is_full_capacity()


def test_fractions_return_to_exactly_full_after_many_cycles() -> None:
    state = pool_of(declared(node("a", gpus=1)))
    for i in range(50):
        state = take(state, Resource(gpu=1 / 3), 3, f"b{i}")
        state = fold_all_onto(state, TokenReleased(rollout_id="r", batch_id=f"b{i}"))
    assert state.nodes["a"].gpu_used == {0: 0.0}
    assert state.is_full_capacity()


# ---------------------------------------------------------------- ungated


def test_ungated_pool_admits_everything_with_node_less_tokens() -> None:
    for state in (PoolState(), pool_of(PoolDeclared(nodes=[]))):
        assert not state.gated
        per = Resource(gpu=8, cpu=10_000)
        budget = Resource(gpu=32, cpu=40_000, concurrency=4)
        grants = try_acquire_batch(state, budget, per, 9, token_prefix="r:b0")
        assert grants is not None
        assert [g.token_id for g in grants] == [f"r:b0:t{i}" for i in range(4)]
        assert all(g.node == "" and g.gpus == [] and g.cpu == 0 for g in grants)
        state = fold_all_onto(state, acquired("r:b0", grants))
        assert state.over_allocation() == [] and state.tokens_held == 4
        assert max_tokens_for(state, per) == UNBOUNDED


def test_max_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        try_acquire_batch(PoolState(), BIG, Resource(), 0)


# ---------------------------------------------------------------- real admission, end to end


async def test_real_admission_carries_each_tokens_gpus_to_the_placement_log(
    redis_factory: ClientFactory, tmp_path: Path
) -> None:
    # The scheduler admits on a layout with GPUs; a worker runs the batches and the
    # finalizer writes placement.jsonl. No event here is built by hand.
    config = write_config(tmp_path, {"gsm": ("scripted", 4)})
    gpu_config = FIXTURES / "evaluators_gpu.py"
    cluster = layout({"gpu-node": {"gpus": [0, 1], "cpu": 16, "memory_gb": 64}})
    scheduler = make_scheduler(
        fresh_client_log(redis_factory, "s0"), config, load_specs(gpu_config), cluster
    )
    engine = Engine(
        lambda: RedisEventLog(redis_factory(), producer="test", block_ms=100, max_deliveries=3),
        load_evaluators(gpu_config, None),
    )
    out = tmp_path / "out"
    engine.start_worker("w1")
    engine.start_finalizer(out_dir=out)
    log = fresh_client_log(redis_factory, "trainer")
    await log.append(log.names.control, request("r1", n_prompts=4))
    placement = out / "r1" / "placement.jsonl"
    try:
        async with running([scheduler]):
            async with asyncio.timeout(30):
                while not placement.is_file():
                    await asyncio.sleep(0.05)
    finally:
        await engine.close()

    acquired = [e.event for e in await log.read_all(log.names.pool)
                if isinstance(e.event, TokenAcquired)]
    admitted = [e.event for e in await log.read_all(log.names.work("scripted"))
                if isinstance(e.event, BatchAdmitted)]
    assert len(acquired) == len(admitted) == 1
    grants = {g.token_id: [s.gpu for s in g.gpus] for g in acquired[0].tokens}
    assert len(grants) == 4 and all(gpus in ([0], [1]) for gpus in grants.values())
    assert admitted[0].gpus == grants  # admission fills the GPUs of every token it grants
    rows = [json.loads(line) for line in placement.read_text().splitlines()]
    assert len(rows) == 4  # one turn per sample
    assert all(row["node"] == "gpu-node" and row["gpu"] in (0, 1) for row in rows)


def test_an_admission_names_the_gpus_of_each_token_it_grants() -> None:
    batch = BatchSealed(rollout_id="r", batch_id="r:b0", seq=0, evaluator_id="e",
                        sample_ids=["r:s0", "r:s1", "r:s2"])
    budget = Resource(gpu=2, cpu=8, memory_gb=8, concurrency=4)
    gpu = EvaluatorProfile(evaluator_id="e", resource=budget, run_resource=Resource(gpu=0.5))
    decision = decide_admission(pool_of(declared(node("a", gpus=2))), batch, gpu)
    assert decision is not None
    assert decision.admitted.gpus == {"r:b0:t0": [0], "r:b0:t1": [0], "r:b0:t2": [1]}
    assert decision.admitted.gpus == {
        g.token_id: [s.gpu for s in g.gpus] for g in decision.acquired.tokens
    }
    cpu_only = EvaluatorProfile(evaluator_id="e", resource=budget, run_resource=Resource(cpu=1))
    decision = decide_admission(pool_of(declared(node("a", gpus=2))), batch, cpu_only)
    assert decision is not None and decision.admitted.gpus == {}
