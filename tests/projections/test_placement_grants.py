"""The grants ``try_acquire_batch`` builds without the validator are the validated ones.

A batch places a token per sample; each ``TokenGrant`` is filled in from values that are
already validated (``placement.allocation._grant``). Here every grant of varied placements -- GPU
fractions, whole GPUs, CPU and memory only, several nodes, an ungated pool -- equals the
grant the validating constructor builds from the same values: equal, same fields set, same
field order, same bytes inside the ``TokenAcquired``.
"""

from __future__ import annotations

from engine.domain import Resource
from engine.events import Envelope, NodeDecl, PoolDeclared, TokenAcquired, TokenGrant
from engine.events.codec import encode
from engine.projections.placement import PoolState, fold_all, try_acquire_batch

NODES = [
    NodeDecl(node="a", gpus=[0, 1, 2, 3], cpu=64, memory_gb=256),
    NodeDecl(node="b", gpus=[0, 1], cpu=32.5, memory_gb=128),
    NodeDecl(node="c", cpu=16, memory_gb=64),
]
BUDGET = Resource(gpu=64, cpu=1024, memory_gb=4096, concurrency=64)


def _pool(nodes: list[NodeDecl]) -> PoolState:
    return fold_all([Envelope("rl:pool", "1-0", PoolDeclared(nodes=nodes))])


def _validated(grant: TokenGrant) -> TokenGrant:
    if not grant.node:  # an ungated pool's grant names no node and holds nothing
        return TokenGrant(token_id=grant.token_id, node="")
    return TokenGrant(token_id=grant.token_id, node=grant.node, gpus=list(grant.gpus),
                      cpu=grant.cpu, memory_gb=grant.memory_gb)


def test_grants_equal_the_validated_ones() -> None:
    shapes = [
        Resource(gpu=0.25, cpu=1, memory_gb=2),
        Resource(gpu=0.33, cpu=0.5),
        Resource(gpu=2, cpu=4, memory_gb=8),
        Resource(cpu=1),
        Resource(cpu=1.5, memory_gb=0.75),
    ]
    checked = 0
    for per_sample in shapes:
        for nodes in (NODES, []):
            n = 3 if per_sample.gpu > 1 else 12  # whole GPUs: 3 tokens fit the layout
            grants = try_acquire_batch(_pool(nodes), BUDGET, per_sample, n, token_prefix="r:b0")
            assert grants is not None and grants
            for grant in grants:
                want = _validated(grant)
                assert grant == want
                assert grant.model_fields_set == want.model_fields_set
                assert list(grant.__dict__) == list(want.__dict__)
                checked += 1
            acquired = TokenAcquired(rollout_id="r", batch_id="r:b0", evaluator_id="e",
                                     tokens=grants)
            rebuilt = acquired.model_copy(update={"tokens": [_validated(g) for g in grants]})
            assert encode(acquired) == encode(rebuilt)
    assert checked > 50
