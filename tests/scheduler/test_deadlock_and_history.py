"""The start-up deadlock check, and the pool's time travel (state at any past event id)."""

from __future__ import annotations

import pytest

from engine.actors.admission import check_deadlock
from engine.actors.scheduler import check_layout, declaration_for
from engine.domain import EvaluatorProfile, Resource
from engine.errors import DeadlockError
from engine.events import EventLog, NodeDecl, PoolDeclared, TokenAcquired, TokenReleased
from engine.projections.placement import PoolState, pool_of, render_pool, try_acquire_batch
from engine.runtime.rebuild import pool_at
from tests.scheduler.helpers import FIXTURES, layout, load_specs


def spec(
    evaluator_id: str = "swe",
    *,
    per: Resource,
    budget: Resource,
    batch_size: int | None = None,
) -> EvaluatorProfile:
    return EvaluatorProfile(
        evaluator_id=evaluator_id,
        resource=budget,
        run_resource=per,
        batch_size=batch_size,
    )


def four_gpus() -> PoolState:
    return pool_of(PoolDeclared(nodes=[NodeDecl(node="n", gpus=[0, 1, 2, 3], cpu=96,
                                                memory_gb=384)]))


def test_deadlock_names_the_evaluator_and_both_numbers() -> None:
    specs = load_specs(FIXTURES / "evaluators_deadlock.py")
    with pytest.raises(DeadlockError) as info:
        check_deadlock(specs.values(), four_gpus())
    message = str(info.value)
    assert "evaluator 'greedy' needs 8 placement tokens" in message
    assert "the pool can only provide 4" in message
    assert "largest batch 8 samples" in message


def test_tokens_needed_is_the_smaller_of_budget_and_batch() -> None:
    per = Resource(gpu=1, cpu=4, memory_gb=16)
    # Budget pays for 4 tokens, batches hold 8 samples: needs 4 <= 4 GPUs.
    check_deadlock([spec(per=per, budget=Resource(gpu=4, cpu=16, memory_gb=64, concurrency=4),
                         batch_size=8)], four_gpus())
    # Budget pays for 8, batches of 3: needs 3.
    check_deadlock([spec(per=per, budget=Resource(gpu=8, cpu=64, memory_gb=128, concurrency=8),
                         batch_size=3)], four_gpus())
    # Budget 8, no batch size (a batch may be a whole rollout): needs 8 > 4.
    with pytest.raises(DeadlockError, match="needs 8 placement tokens .* any size .* only "
                                            "provide 4"):
        check_deadlock([spec(per=per, budget=Resource(gpu=8, cpu=64, memory_gb=128,
                                                      concurrency=8))], four_gpus())
    # Real batch sizes of a planned rollout override the spec's batch_size.
    budget8 = Resource(gpu=8, cpu=64, memory_gb=128, concurrency=8)
    check_deadlock([spec(per=per, budget=budget8)], four_gpus(), batch_samples={"swe": 4})
    with pytest.raises(DeadlockError, match="needs 5 .* only provide 4"):
        check_deadlock([spec(per=per, budget=budget8)], four_gpus(), batch_samples={"swe": 5})


def test_a_budget_that_pays_for_no_token_is_a_deadlock() -> None:
    broke = spec("broke", per=Resource(cpu=4, memory_gb=16), budget=Resource(cpu=2))
    with pytest.raises(DeadlockError, match="'broke' needs 1 placement token .* pays for 0"):
        check_deadlock([broke], four_gpus())
    with pytest.raises(DeadlockError, match="'broke'"):
        check_deadlock([broke], PoolState())  # even ungated: it could never run a sample


def test_cpu_bound_specs_check_cpu_and_memory_and_ungated_never_deadlocks() -> None:
    specs = load_specs()  # math: 0.5 gpu + 2 cpu + 2 GB, batches of 3; code: 4 cpu + 8 GB, 2
    small = layout({"n": {"gpus": [0], "cpu": 4, "memory_gb": 32}})
    with pytest.raises(DeadlockError, match="'math' needs 3 .* only provide 2"):
        check_layout(specs, small)
    check_layout(specs, layout({"n": {"gpus": [0, 1], "cpu": 8, "memory_gb": 32}}))
    check_layout(specs, None)
    assert declaration_for(None) == PoolDeclared(nodes=[])


async def test_time_travel_prints_the_pool_at_any_past_event(log: EventLog) -> None:
    pool = log.names.pool
    cluster = layout({"gpu-node": {"gpus": [0, 1], "cpu": 16, "memory_gb": 64}})
    declared_id = await log.append(pool, declaration_for(cluster))
    state = (await pool_at(log)).state
    per = Resource(gpu=0.5, cpu=2, memory_gb=8)
    grants = try_acquire_batch(state, Resource(gpu=4, cpu=16, memory_gb=64, concurrency=8), per,
                               3, token_prefix="r1:b0")
    assert grants is not None
    acquired_id = await log.append(pool, TokenAcquired(rollout_id="r1", batch_id="r1:b0",
                                                       evaluator_id="math", tokens=grants))
    released_id = await log.append(pool, TokenReleased(rollout_id="r1", batch_id="r1:b0",
                                                       token_ids=["r1:b0:t0"]))

    at_declare = await pool_at(log, until=declared_id)
    assert at_declare.position == declared_id and at_declare.state.tokens_held == 0
    at_acquire = await pool_at(log, until=acquired_id)
    assert at_acquire.state.tokens_held == 3
    at_release = await pool_at(log, until=released_id)
    assert at_release.state.tokens_held == 2

    table = render_pool(at_acquire)
    lines = table.splitlines()
    assert lines[0] == (
        f"pool at {acquired_id} (2 events folded): 1 node, 1 batch holding 3 tokens"
    )
    row = next(line for line in lines if line.startswith("gpu-node"))
    assert row.split() == ["gpu-node", "1.50/2", "6/16", "24/64", "3"]
    assert "  gpu 0   1.00/1 (2 tokens)" in lines
    assert "  gpu 1   0.50/1 (1 token)" in lines
    assert lines[-1] == "batch r1:b0 (rollout r1): 3 tokens on gpu-node"
    assert render_pool(at_release).splitlines()[0].endswith("1 batch holding 2 tokens")
    assert "ungated" in render_pool(await pool_at(log, until="0-0"))
