"""Placement decisions on a folded pool: pure functions, the state is never modified.

``try_acquire_batch(state, budget, per_sample, max_tokens)`` takes tokens one ``per_sample``
at a time until the evaluator's ``budget`` is spent or ``max_tokens`` (the batch's sample
count) is reached, so a batch needs exactly ``n = min(budget_tokens(budget, per_sample),
max_tokens)`` tokens. "Spending the budget" is field by field: ``gpu``, ``cpu`` and
``memory_gb`` of the budget pay for as many per-sample amounts as they cover (a field the
sample does not use never limits), and ``concurrency`` too (each token is one sample running
at once, so a budget with ``concurrency=c`` pays for at most ``c`` tokens). Every one of the
``n`` tokens must be placed or none is: on the first token that fits nowhere the result is
``None`` and nothing is taken (all-or-nothing; the batch waits instead of half-committing).

Each token goes to the node with the most free GPU capacity (ties: most free CPU, then
memory, then layout order) among those it fits on; cross-node batches are normal. On a node a
fractional sample (``0 < gpu <= 1``) best-fits: it takes the GPU whose remaining capacity is
the smallest that still covers it (each GPU has capacity 1.0, so ``gpu=0.33`` packs three per
GPU); a sample of ``k >= 2`` whole GPUs takes ``k`` completely free GPUs of one node; a
``gpu=0`` sample gates on CPU and memory alone.

Ungated pools admit everything: the grants carry no resources and ``node=""``. Tokens are
named ``f"{token_prefix}:t{i}"`` (``i`` counts from 0 within the batch) whether gated or not;
the scheduler uses the batch id as the prefix, so token ids are unique across the pool.

``max_tokens_for(state, per_sample)`` is how many such tokens the declared pool can ever hold
at once (on an empty pool): per node the minimum over GPU slots (``floor(1/gpu)`` per GPU, or
``floor(gpus/k)`` for whole GPUs), ``floor(cpu/cpu)`` and ``floor(memory/memory)``, summed
over nodes. ``UNBOUNDED`` when nothing gates (ungated pool, or an all-zero sample).
"""

from __future__ import annotations

import bisect
import math
import sys
from dataclasses import dataclass

from engine.domain import Resource
from engine.errors import PlacementError
from engine.events.catalog import GpuShare, NodeDecl, TokenGrant
from engine.projections.placement.pool import EPS, NodeKey, NodeUsage, PoolState

__all__ = [
    "UNBOUNDED",
    "budget_tokens",
    "describe_resource",
    "max_tokens_for",
    "try_acquire_batch",
]

UNBOUNDED = sys.maxsize
"""What ``max_tokens_for`` answers when nothing limits the number of tokens."""


def budget_tokens(budget: Resource, per_sample: Resource) -> int:
    """How many ``per_sample`` tokens the evaluator's ``budget`` pays for (see module doc)."""
    limits = [budget.concurrency // per_sample.concurrency]
    for have, need in (
        (budget.gpu, per_sample.gpu),
        (budget.cpu, per_sample.cpu),
        (budget.memory_gb, per_sample.memory_gb),
    ):
        if need > 0:
            limits.append(math.floor(have / need + EPS))
    return max(0, min(limits))


def _node_slots(decl: NodeDecl, per_sample: Resource) -> int:
    """Tokens of ``per_sample`` an empty node holds (``UNBOUNDED`` if nothing limits)."""
    limits: list[int] = []
    gpu = per_sample.gpu
    if gpu > 0:
        if gpu <= 1:
            limits.append(len(decl.gpus) * math.floor(1.0 / gpu + EPS))
        else:
            limits.append(len(decl.gpus) // round(gpu))
    if per_sample.cpu > 0:
        limits.append(math.floor(decl.cpu / per_sample.cpu + EPS))
    if per_sample.memory_gb > 0:
        limits.append(math.floor(decl.memory_gb / per_sample.memory_gb + EPS))
    return min(limits) if limits else UNBOUNDED


def max_tokens_for(state: PoolState, per_sample: Resource) -> int:
    """How many ``per_sample`` tokens the declared pool can ever hold at once."""
    if not state.gated:
        return UNBOUNDED
    total = 0
    for node in state.nodes.values():
        slots = _node_slots(node.decl, per_sample)
        if slots == UNBOUNDED:
            return UNBOUNDED
        total += slots
    return total


@dataclass(slots=True)
class _Free:
    """Scratch copy of one node's free capacity while a batch is being placed."""

    name: str
    order: int
    cpu: float
    memory: float
    gpus: dict[int, float]
    gpu_total: float

    @classmethod
    def of(cls, node: NodeUsage) -> _Free:
        return cls(
            name=node.name,
            order=node.order,
            cpu=node.free_cpu,
            memory=node.free_memory,
            gpus={gpu: 1.0 - used for gpu, used in node.gpu_used.items()},
            gpu_total=node.free_gpu,
        )

    @property
    def key(self) -> NodeKey:
        return (-self.gpu_total, -self.cpu, -self.memory, self.order)

    def fit(self, per_sample: Resource) -> list[GpuShare] | None:
        if per_sample.cpu > self.cpu + EPS or per_sample.memory_gb > self.memory + EPS:
            return None
        want = per_sample.gpu
        if want == 0:
            return []
        if want <= 1:
            best: int | None = None
            best_left = math.inf
            for gpu, left in self.gpus.items():
                if left + EPS >= want and left < best_left:
                    best, best_left = gpu, left
            if best is None:
                return None
            return [GpuShare(gpu=best, fraction=want)]
        whole = round(want)
        free = [gpu for gpu, left in self.gpus.items() if left >= 1.0 - EPS][:whole]
        if len(free) < whole:
            return None
        return [GpuShare(gpu=gpu, fraction=1.0) for gpu in free]

    def take(self, per_sample: Resource, shares: list[GpuShare]) -> None:
        self.cpu -= per_sample.cpu
        self.memory -= per_sample.memory_gb
        for share in shares:
            self.gpus[share.gpu] -= share.fraction
            self.gpu_total -= share.fraction


_new = object.__new__
_set = object.__setattr__
_GRANT_FIELDS = frozenset(TokenGrant.model_fields)


def _grant(token_id: str, node: str, shares: list[GpuShare], per_sample: Resource) -> TokenGrant:
    """``TokenGrant(token_id=..., node=..., gpus=shares, cpu=..., memory_gb=...)`` for the
    batch's hot loop (a token per sample). Every value already has its field's exact type
    -- strings, a fresh list of validated ``GpuShare``, the validated resource's floats --
    so the instance is filled in as ``model_construct`` would, without the validator; equal
    to the validated one, fields set included. Anything else is validated."""
    cpu, memory = per_sample.cpu, per_sample.memory_gb
    if type(cpu) is not float or type(memory) is not float or type(node) is not str:
        return TokenGrant(token_id=token_id, node=node, gpus=shares, cpu=cpu, memory_gb=memory)
    grant = _new(TokenGrant)
    _set(grant, "__dict__", {
        "token_id": token_id, "node": node, "gpus": shares, "cpu": cpu, "memory_gb": memory,
    })
    _set(grant, "__pydantic_fields_set__", set(_GRANT_FIELDS))
    _set(grant, "__pydantic_extra__", None)
    _set(grant, "__pydantic_private__", None)
    return grant


def try_acquire_batch(
    state: PoolState,
    budget: Resource,
    per_sample: Resource,
    max_tokens: int,
    *,
    token_prefix: str = "batch",
) -> list[TokenGrant] | None:
    """All-or-nothing placement of ``min(budget_tokens, max_tokens)`` tokens, or ``None``.

    Pure: ``state`` is not modified; the caller records the grants as a ``TokenAcquired``.
    Raises ``PlacementError`` when the budget pays for no token at all (a configuration the
    start-up deadlock check refuses) and ``ValueError`` for ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    affordable = budget_tokens(budget, per_sample)
    if affordable < 1:
        raise PlacementError(
            f"budget {describe_resource(budget)} pays for no token of "
            f"{describe_resource(per_sample)}"
        )
    n = min(affordable, max_tokens)
    if not state.gated:
        return [TokenGrant(token_id=f"{token_prefix}:t{i}", node="") for i in range(n)]
    # Nodes in placement preference (the fold keeps the order); only the nodes a token
    # lands on get a scratch copy, and only they move in the order.
    order = list(state.order)
    scratch: dict[str, _Free] = {}
    grants: list[TokenGrant] = []
    for i in range(n):
        for position, (_, name) in enumerate(order):
            free = scratch.get(name) or _Free.of(state.nodes[name])
            shares = free.fit(per_sample)
            if shares is None:
                continue
            scratch[name] = free
            free.take(per_sample, shares)
            del order[position]
            bisect.insort(order, (free.key, name))
            grants.append(_grant(f"{token_prefix}:t{i}", name, shares, per_sample))
            break
        else:
            return None
    return grants


def describe_resource(resource: Resource) -> str:
    return (
        f"gpu={resource.gpu:g} cpu={resource.cpu:g} memory_gb={resource.memory_gb:g} "
        f"concurrency={resource.concurrency}"
    )
