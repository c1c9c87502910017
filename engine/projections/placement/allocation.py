"""Placement decisions on a folded pool: pure functions, the state is never modified.

A batch needs ``n = min(budget_tokens(budget, per_sample), max_tokens)`` tokens: each of the
budget's ``gpu``, ``cpu``, ``memory_gb`` and ``concurrency`` pays for as many per-sample
amounts as it covers (a field the sample does not use never limits). All ``n`` are placed or
none is: the batch waits rather than half-commits.

Each token goes to the node with the most free GPU capacity (ties: most free CPU, then memory,
then layout order) it fits on. On a node a fractional sample (``0 < gpu <= 1``) takes the GPU
with the least remaining capacity that still covers it (``gpu=0.33`` packs three per GPU); a
sample of ``k >= 2`` GPUs takes ``k`` free GPUs of one node; a ``gpu=0`` sample gates on CPU
and memory alone. Ungated pools admit everything with ``node=""``. Tokens are named
``f"{token_prefix}:t{i}"``; the scheduler's prefix is the batch id, so ids are unique.
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
    """How many ``per_sample`` tokens the declared pool can ever hold at once, summed over
    nodes; ``UNBOUNDED`` when nothing gates (ungated pool, or an all-zero sample)."""
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
    """``TokenGrant(...)`` without the validator, for the per-sample hot loop: every value
    already has its field's exact type, so the result equals the validated one. Anything
    else is validated."""
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
    """All-or-nothing placement of ``min(budget_tokens, max_tokens)`` tokens, or ``None``;
    the caller records the grants as a ``TokenAcquired``. Raises ``PlacementError`` when the
    budget pays for no token (the start-up deadlock check refuses that configuration) and
    ``ValueError`` for ``max_tokens < 1``."""
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
    # Only the nodes a token lands on get a scratch copy, and only they move in the order.
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
