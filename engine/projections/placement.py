"""The placement pool: a pure projection of ``rl:pool`` and pure allocation on its state.

Fold (``PoolProjection``)
-------------------------
* ``PoolDeclared`` replaces the node set. Tokens already held stay held and are re-counted
  against the new nodes (a token on a node that is gone counts against nothing); a
  declaration with no nodes means "no layout": the pool is *ungated*. Before any declaration
  the pool is ungated too.
* ``TokenAcquired`` takes the listed tokens' capacity. A second ``TokenAcquired`` for a batch
  that has ever acquired (same ``(rollout_id, batch_id)``) is a duplicate and ignored, so a
  batch is placed at most once; ``acquired`` remembers every such batch, which is what a
  resuming scheduler asks ("does this batch already have tokens?").
* ``TokenReleased`` gives back the listed tokens the batch still holds or, with
  ``token_ids=None``, every token it still holds. Unknown batches, unknown tokens and
  repeated releases are ignored, so releasing is idempotent.
* ``BatchLeased`` records that a worker took the batch over under a newer lease (the work
  entry's delivery count); a later ``TokenReleased`` with an older ``lease`` is a late write
  of a previous holder and is ignored (fencing): its tokens are still in use by the new
  holder. Releases written before leases existed carry lease 0 and no ``BatchLeased``
  precedes them, so old logs fold as before.
* ``AdmissionClosed`` records that the scheduler admitted the rollout's last batch. From
  then on every batch of the rollout answers ``has_acquired`` (a resumed request admits
  nothing more), a ``TokenAcquired`` for it is ignored, and the fold *forgets* each of its
  batches once the batch holds no token: its ``acquired`` key and lease go. So the record
  of admitted batches holds the batches of rollouts still being admitted plus the batches
  still holding tokens, and ``closed`` one id per rollout, instead of one key per batch
  ever admitted. Forgetting never changes a decision: a forgotten batch holds nothing, and
  a late release or lease for it is ignored as it would be after its last release.
* The fold applies acquisitions as written, even ones that do not fit: it records what
  happened, and ``over_allocation`` reports any node, GPU, CPU or memory over capacity (the
  invariant every prefix of the stream must satisfy).

Allocation (pure; the state is never modified)
----------------------------------------------
``try_acquire_batch(state, budget, per_sample, max_tokens)`` follows the seed
(task-scheduler §3, ``PlacementPool.try_acquire_batch``): it takes tokens one ``per_sample``
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

Time travel: ``engine.runtime.rebuild.pool_at(log, until=id)`` folds ``rl:pool`` up to an
event id and ``render_pool`` prints it as a table.

Performance note: like the rollout projection, ``evolve`` updates the state in place and
returns it, so folding a long pool history stays linear; take ``copy()`` before keeping a
state that a later fold would extend. Held tokens are kept as compact ``Held`` tuples
(``held_by`` turns them back into grants) and the nodes' placement order is maintained by
the fold, so a decision costs O(tokens x nodes) whatever the pool holds.

Snapshot: ``PoolProjection`` is ``Snapshottable`` (``dump`` / ``load`` turn a state into
plain msgpack-able values and back), so a reader starts from the stored snapshot and folds
only the tail (``engine.runtime.live.LiveFold`` does so by itself); this is what lets
retention trim ``rl:pool`` below a snapshot (``engine.ops.retention``).
"""

from __future__ import annotations

import bisect
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.domain import Resource
from engine.errors import PlacementError
from engine.events.base import Envelope
from engine.events.catalog import (
    AdmissionClosed,
    BatchLeased,
    GpuShare,
    NodeDecl,
    PoolDeclared,
    TokenAcquired,
    TokenGrant,
    TokenReleased,
)
from engine.projections.base import Folded

__all__ = [
    "EPS",
    "Held",
    "UNBOUNDED",
    "BatchKey",
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

EPS = 1e-9
"""Tolerance of capacity comparisons (``3 * 0.33`` must fit on one GPU, ``3 * (1/3)`` too)."""

UNBOUNDED = sys.maxsize
"""What ``max_tokens_for`` answers when nothing limits the number of tokens."""

BatchKey = tuple[str, str]
"""``(rollout_id, batch_id)``."""

NodeKey = tuple[float, float, float, int]


class Held(NamedTuple):
    """A held token, compactly: a 100k-token pool keeps no pydantic objects alive (they
    would cost memory and every garbage-collector pass)."""

    node: str
    gpus: tuple[tuple[int, float], ...]
    cpu: float
    memory_gb: float

    @classmethod
    def of(cls, grant: TokenGrant) -> Held:
        return cls(
            grant.node,
            tuple((share.gpu, share.fraction) for share in grant.gpus),
            grant.cpu,
            grant.memory_gb,
        )

    def grant(self, token_id: str) -> TokenGrant:
        return TokenGrant(
            token_id=token_id,
            node=self.node,
            gpus=[GpuShare(gpu=gpu, fraction=fraction) for gpu, fraction in self.gpus],
            cpu=self.cpu,
            memory_gb=self.memory_gb,
        )


@dataclass(slots=True)
class NodeUsage:
    """One declared node and what the held tokens use of it.

    Usage returns to exactly zero when the last holder of a GPU (or of the node) releases,
    so float rounding never leaves a pool short after a full cycle.
    """

    decl: NodeDecl
    order: int
    gpu_used: dict[int, float] = field(default_factory=dict)
    gpu_holders: dict[int, int] = field(default_factory=dict)
    cpu_used: float = 0.0
    memory_used: float = 0.0
    holders: int = 0
    gpu_used_total: float = 0.0

    @classmethod
    def of(cls, decl: NodeDecl, order: int) -> NodeUsage:
        return cls(
            decl=decl,
            order=order,
            gpu_used={gpu: 0.0 for gpu in decl.gpus},
            gpu_holders={gpu: 0 for gpu in decl.gpus},
        )

    @property
    def name(self) -> str:
        return self.decl.node

    @property
    def free_gpu(self) -> float:
        return len(self.gpu_used) - self.gpu_used_total

    @property
    def key(self) -> NodeKey:
        """Placement preference: most free GPU, then CPU, then memory, then layout order."""
        return (-self.free_gpu, -self.free_cpu, -self.free_memory, self.order)

    @property
    def free_cpu(self) -> float:
        return self.decl.cpu - self.cpu_used

    @property
    def free_memory(self) -> float:
        return self.decl.memory_gb - self.memory_used

    def copy(self) -> NodeUsage:
        return NodeUsage(
            decl=self.decl,
            order=self.order,
            gpu_used=dict(self.gpu_used),
            gpu_holders=dict(self.gpu_holders),
            cpu_used=self.cpu_used,
            memory_used=self.memory_used,
            holders=self.holders,
            gpu_used_total=self.gpu_used_total,
        )

    def take(self, grant: Held) -> None:
        self.cpu_used += grant.cpu
        self.memory_used += grant.memory_gb
        self.holders += 1
        for gpu, fraction in grant.gpus:
            if gpu in self.gpu_used:
                self.gpu_used[gpu] += fraction
                self.gpu_holders[gpu] += 1
        if grant.gpus:
            self.gpu_used_total = sum(self.gpu_used.values())

    def give_back(self, grant: Held) -> None:
        self.holders -= 1
        if self.holders <= 0:
            self.holders, self.cpu_used, self.memory_used = 0, 0.0, 0.0
        else:
            self.cpu_used -= grant.cpu
            self.memory_used -= grant.memory_gb
        for gpu, fraction in grant.gpus:
            if gpu not in self.gpu_used:
                continue
            self.gpu_holders[gpu] -= 1
            if self.gpu_holders[gpu] <= 0:
                self.gpu_holders[gpu], self.gpu_used[gpu] = 0, 0.0
            else:
                self.gpu_used[gpu] -= fraction
        if grant.gpus:
            self.gpu_used_total = sum(self.gpu_used.values())


@dataclass(slots=True)
class PoolState:
    """The pool as folded from ``rl:pool``; see the module docstring for the rules."""

    declared: PoolDeclared | None = None
    nodes: dict[str, NodeUsage] = field(default_factory=dict)
    held: dict[BatchKey, dict[str, Held]] = field(default_factory=dict)
    acquired: set[BatchKey] = field(default_factory=set)
    leases: dict[BatchKey, int] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)  # rollouts whose admission is closed
    fenced: int = 0  # releases ignored as late writes of a previous holder
    events: int = 0
    # Nodes sorted by placement preference, kept current by the fold so that a decision
    # does not re-sort the whole cluster.
    order: list[tuple[NodeKey, str]] = field(default_factory=list)

    @property
    def gated(self) -> bool:
        """Whether a layout is declared (with no layout every batch is admitted)."""
        return bool(self.nodes)

    @property
    def tokens_held(self) -> int:
        return sum(len(tokens) for tokens in self.held.values())

    def has_acquired(self, rollout_id: str, batch_id: str) -> bool:
        """Whether the batch has had its ``TokenAcquired`` (held or since released), or its
        rollout's admission is closed (every batch of it was admitted)."""
        return (rollout_id, batch_id) in self.acquired or rollout_id in self.closed

    def is_closed(self, rollout_id: str) -> bool:
        """Whether ``AdmissionClosed`` was recorded for the rollout."""
        return rollout_id in self.closed

    def held_by(self, rollout_id: str, batch_id: str) -> dict[str, TokenGrant]:
        """The tokens the batch still holds, as grants."""
        tokens = self.held.get((rollout_id, batch_id), {})
        return {token_id: held.grant(token_id) for token_id, held in tokens.items()}

    def copy(self) -> PoolState:
        return PoolState(
            declared=self.declared,
            nodes={name: node.copy() for name, node in self.nodes.items()},
            held={key: dict(tokens) for key, tokens in self.held.items()},
            acquired=set(self.acquired),
            leases=dict(self.leases),
            closed=set(self.closed),
            fenced=self.fenced,
            events=self.events,
            order=list(self.order),
        )

    def over_allocation(self) -> list[str]:
        """Every capacity the held tokens exceed, as readable lines (empty: all is well)."""
        problems: list[str] = []
        for node in self.nodes.values():
            d = node.decl
            if node.cpu_used > d.cpu + EPS:
                problems.append(f"node {d.node!r}: cpu {node.cpu_used:g} used of {d.cpu:g}")
            if node.memory_used > d.memory_gb + EPS:
                problems.append(
                    f"node {d.node!r}: memory {node.memory_used:g} GB used of {d.memory_gb:g}"
                )
            for gpu, used in node.gpu_used.items():
                if used > 1.0 + EPS:
                    problems.append(f"node {d.node!r}: gpu {gpu} {used:g} used of 1")
        return problems

    def is_full_capacity(self) -> bool:
        """No token held and every node entirely free."""
        if self.held:
            return False
        return all(
            node.holders == 0
            and node.cpu_used == 0.0
            and node.memory_used == 0.0
            and all(used == 0.0 for used in node.gpu_used.values())
            for node in self.nodes.values()
        )


class PoolProjection:
    """Folds ``rl:pool`` into a :class:`PoolState`; snapshottable (module docstring)."""

    name = "pool"

    def initial(self) -> PoolState:
        return PoolState()

    def dump(self, state: PoolState) -> dict[str, Any]:
        return _dump(state)

    def load(self, data: Any) -> PoolState:
        return _load(data)

    def evolve(self, state: PoolState, env: Envelope) -> PoolState:
        ev = env.event
        if isinstance(ev, PoolDeclared):
            _declare(state, ev)
        elif isinstance(ev, TokenAcquired):
            _acquire(state, ev)
        elif isinstance(ev, TokenReleased):
            _release(state, ev)
        elif isinstance(ev, BatchLeased):
            key = (ev.rollout_id, ev.batch_id)
            if ev.rollout_id not in state.closed or key in state.held:
                state.leases[key] = max(state.leases.get(key, 0), ev.lease)
        elif isinstance(ev, AdmissionClosed):
            _close(state, ev.rollout_id)
        state.events += 1
        return state


def _declare(state: PoolState, ev: PoolDeclared) -> None:
    state.declared = ev
    state.nodes = {decl.node: NodeUsage.of(decl, i) for i, decl in enumerate(ev.nodes)}
    for tokens in state.held.values():
        for grant in tokens.values():
            node = state.nodes.get(grant.node)
            if node is not None:
                node.take(grant)
    state.order = sorted((node.key, name) for name, node in state.nodes.items())


def _touch(state: PoolState, node: NodeUsage, before: NodeKey) -> None:
    """Move ``node`` to its new place in ``state.order`` after its usage changed."""
    order = state.order
    del order[bisect.bisect_left(order, (before, node.name))]
    bisect.insort(order, (node.key, node.name))


def _reorder(state: PoolState, before: dict[str, NodeKey]) -> None:
    """Re-place every node in ``before`` (its key before a whole event's grants changed
    it): one move per node and event instead of one per token -- a batch's 256 tokens
    usually land on one node."""
    for name, key in before.items():
        _touch(state, state.nodes[name], key)


def _close(state: PoolState, rollout_id: str) -> None:
    state.closed.add(rollout_id)
    for key in [k for k in state.acquired if k[0] == rollout_id and k not in state.held]:
        _forget(state, key)


def _forget(state: PoolState, key: BatchKey) -> None:
    state.acquired.discard(key)
    state.leases.pop(key, None)


def _acquire(state: PoolState, ev: TokenAcquired) -> None:
    key = (ev.rollout_id, ev.batch_id)
    if key in state.acquired or ev.rollout_id in state.closed:
        return
    state.acquired.add(key)
    tokens: dict[str, Held] = {}
    before: dict[str, NodeKey] = {}
    for token in ev.tokens:
        if token.token_id in tokens:
            continue
        grant = tokens[token.token_id] = Held.of(token)
        node = state.nodes.get(grant.node)
        if node is not None:
            if grant.node not in before:
                before[grant.node] = node.key
            node.take(grant)
    _reorder(state, before)
    if tokens:
        state.held[key] = tokens


def _release(state: PoolState, ev: TokenReleased) -> None:
    key = (ev.rollout_id, ev.batch_id)
    tokens = state.held.get(key)
    if tokens is None:
        return
    if ev.lease < state.leases.get(key, 0):
        state.fenced += 1
        return
    ids = list(tokens) if ev.token_ids is None else ev.token_ids
    before: dict[str, NodeKey] = {}
    for token_id in ids:
        grant = tokens.pop(token_id, None)
        if grant is None:
            continue
        node = state.nodes.get(grant.node)
        if node is not None:
            if grant.node not in before:
                before[grant.node] = node.key
            node.give_back(grant)
    _reorder(state, before)
    if not tokens:
        del state.held[key]
        if key[0] in state.closed:
            _forget(state, key)


# ---------------------------------------------------------------- allocation


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


# ---------------------------------------------------------------- rendering


def describe_resource(resource: Resource) -> str:
    return (
        f"gpu={resource.gpu:g} cpu={resource.cpu:g} memory_gb={resource.memory_gb:g} "
        f"concurrency={resource.concurrency}"
    )


def _count(n: int, noun: str) -> str:
    plural = noun + ("es" if noun.endswith("ch") else "s")
    return f"{n} {noun if n == 1 else plural}"


def render_pool(folded: Folded[PoolState]) -> str:
    """A readable table of the pool: nodes with used/total capacity, GPUs, holding batches."""
    state = folded.state
    lines = [
        f"pool at {folded.position} ({_count(state.events, 'event')} folded): "
        + (_count(len(state.nodes), "node") if state.gated else "ungated (no layout declared)")
        + f", {_count(len(state.held), 'batch')} holding {_count(state.tokens_held, 'token')}"
    ]
    if state.gated:
        lines.append(
            f"{'node':<20} {'gpu used/total':>15} {'cpu used/total':>15} "
            f"{'mem GB used/total':>18} {'tokens':>7}"
        )
        for node in state.nodes.values():
            d = node.decl
            gpu_used = sum(node.gpu_used.values())
            lines.append(
                f"{d.node:<20} {f'{gpu_used:.2f}/{len(d.gpus)}':>15} "
                f"{f'{node.cpu_used:g}/{d.cpu:g}':>15} "
                f"{f'{node.memory_used:g}/{d.memory_gb:g}':>18} {node.holders:>7}"
            )
            for gpu, used in node.gpu_used.items():
                holders = _count(node.gpu_holders[gpu], "token")
                lines.append(f"  gpu {gpu:<3} {used:.2f}/1 ({holders})")
        problems = state.over_allocation()
        lines.extend(f"OVER-ALLOCATED: {p}" for p in problems)
    for (rollout_id, batch_id), tokens in state.held.items():
        nodes = sorted({grant.node or "-" for grant in tokens.values()})
        lines.append(
            f"batch {batch_id} (rollout {rollout_id}): {_count(len(tokens), 'token')} on "
            + ", ".join(nodes)
        )
    return "\n".join(lines)


_SNAPSHOT_VERSION = 1


def _dump(state: PoolState) -> dict[str, Any]:
    return {
        "v": _SNAPSHOT_VERSION,
        "declared": None if state.declared is None else state.declared.model_dump(mode="json"),
        "held": [
            [rid, bid, [[tid, h.node, [list(g) for g in h.gpus], h.cpu, h.memory_gb]
                        for tid, h in tokens.items()]]
            for (rid, bid), tokens in state.held.items()
        ],
        "acquired": [list(key) for key in sorted(state.acquired)],
        "leases": [[rid, bid, lease] for (rid, bid), lease in state.leases.items()],
        "closed": sorted(state.closed),
        "fenced": state.fenced,
        "events": state.events,
    }


def _load(doc: Any) -> PoolState:
    """The state ``_dump`` wrote: held tokens, node usage (re-counted from the tokens), the
    record of admitted batches, leases and closed rollouts."""
    if not isinstance(doc, dict) or doc.get("v") != _SNAPSHOT_VERSION:
        found = doc.get("v") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"pool snapshot: version {found!r}, expected {_SNAPSHOT_VERSION}")
    state = PoolState(
        held={
            (rid, bid): {
                tid: Held(node, tuple((int(g), float(f)) for g, f in gpus), cpu, memory)
                for tid, node, gpus, cpu, memory in tokens
            }
            for rid, bid, tokens in doc["held"]
        },
        acquired={(rid, bid) for rid, bid in doc["acquired"]},
        leases={(rid, bid): lease for rid, bid, lease in doc["leases"]},
        closed=set(doc["closed"]),
        fenced=doc["fenced"],
        events=doc["events"],
    )
    if doc["declared"] is not None:
        _declare(state, PoolDeclared.model_validate(doc["declared"]))
    return state


def pool_of(declaration: PoolDeclared) -> PoolState:
    """A fresh pool with ``declaration`` and nothing held (what a layout alone provides)."""
    state = PoolState()
    _declare(state, declaration)
    return state


def fold_all(envelopes: Iterable[Envelope]) -> PoolState:
    """Fold envelopes into a fresh state (a convenience for tests and tools)."""
    projection = PoolProjection()
    state = projection.initial()
    for env in envelopes:
        state = projection.evolve(state, env)
    return state
