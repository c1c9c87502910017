"""The placement pool: the fold of ``rl:pool`` (``pool``) and the pure placement decisions
taken on its state (``allocation``). Both are pure: no I/O, and a decision never modifies
the state it reads; the scheduler records the grants it decides as ``TokenAcquired``."""

from engine.projections.placement.allocation import (
    UNBOUNDED,
    budget_tokens,
    describe_resource,
    max_tokens_for,
    try_acquire_batch,
)
from engine.projections.placement.pool import (
    EPS,
    BatchKey,
    Held,
    NodeUsage,
    PoolProjection,
    PoolState,
    fold_all,
    pool_of,
    render_pool,
)

__all__ = [
    "EPS",
    "UNBOUNDED",
    "BatchKey",
    "Held",
    "NodeUsage",
    "PoolProjection",
    "PoolState",
    "budget_tokens",
    "describe_resource",
    "fold_all",
    "max_tokens_for",
    "pool_of",
    "render_pool",
    "try_acquire_batch",
]
