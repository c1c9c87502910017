"""The placement pool as folded from ``rl:pool``: a pure projection, snapshottable.

* ``PoolDeclared`` replaces the node set; held tokens stay held and are re-counted against
  the new nodes (one on a node that is gone counts against nothing). No declaration, or one
  with no nodes, means an *ungated* pool.
* ``TokenAcquired`` takes the listed tokens' capacity. A second one for a batch that has ever
  acquired is a duplicate and ignored, so a batch is placed at most once; ``acquired``
  answers a resuming scheduler's "does this batch already have tokens?".
* ``TokenReleased`` gives back the listed tokens (all, with ``token_ids=None``) the batch
  still holds; unknown batches or tokens and repeated releases are ignored (idempotent).
* ``BatchLeased`` fences: a later release with an older ``lease`` is a late write of a
  previous holder and is ignored, its tokens being in use by the new holder.
* ``AdmissionClosed``: every batch of the rollout then answers ``has_acquired``, further
  acquisitions are ignored, and each batch is forgotten once it holds no token, so the record
  stays bounded. Forgetting never changes a decision: a late release or lease for a forgotten
  batch is ignored as it would be after its last release.
* Acquisitions are applied as written, even ones that do not fit: the fold records what
  happened, and ``over_allocation`` reports any capacity exceeded (the invariant every prefix
  of the stream must satisfy).

``evolve`` updates the state in place and returns it, so folding a long pool history stays
linear; take ``copy()`` before keeping a state that a later fold would extend. Held tokens are
compact ``Held`` tuples and the fold keeps the nodes' placement order, so a decision
(``allocation``) costs O(tokens x nodes) whatever the pool holds.

``dump`` / ``load`` turn a state into plain msgpack-able values and back, so a reader starts
from a stored snapshot and folds only the tail (``engine.runtime.follower.Follower``), which lets
retention trim ``rl:pool`` below a snapshot. ``engine.runtime.rebuild.pool_at`` folds the
stream up to an event id and ``render_pool`` prints the state as a table.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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
    "BatchKey",
    "Held",
    "NodeKey",
    "NodeUsage",
    "PoolProjection",
    "PoolState",
    "fold_all",
    "pool_of",
    "render_pool",
]

EPS = 1e-9
"""Tolerance of capacity comparisons (``3 * 0.33`` must fit on one GPU, ``3 * (1/3)`` too)."""

BatchKey = tuple[str, str]
"""``(rollout_id, batch_id)``."""

NodeKey = tuple[float, float, float, int]


class Held(NamedTuple):
    """A held token without pydantic objects, which a large pool would pay for in memory
    and in every garbage-collector pass."""

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
    """One declared node and what the held tokens use of it. Usage returns to exactly zero
    when the last holder of a GPU (or node) releases, so float rounding never leaves a pool
    short after a full cycle."""

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
    declared: PoolDeclared | None = None
    nodes: dict[str, NodeUsage] = field(default_factory=dict)
    held: dict[BatchKey, dict[str, Held]] = field(default_factory=dict)
    acquired: set[BatchKey] = field(default_factory=set)
    leases: dict[BatchKey, int] = field(default_factory=dict)
    closed: set[str] = field(default_factory=set)  # rollouts whose admission is closed
    fenced: int = 0  # releases ignored as late writes of a previous holder
    events: int = 0
    # Nodes by placement preference, kept current so that a decision does not re-sort.
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
        return rollout_id in self.closed

    def held_by(self, rollout_id: str, batch_id: str) -> dict[str, TokenGrant]:
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
    order = state.order
    del order[bisect.bisect_left(order, (before, node.name))]
    bisect.insort(order, (node.key, node.name))


def _reorder(state: PoolState, before: dict[str, NodeKey]) -> None:
    """Re-place every node of ``before`` (its key before the event): one move per node and
    event rather than per token, since a batch's tokens usually land on one node."""
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


# ---------------------------------------------------------------- rendering


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
    """The state ``_dump`` wrote; node usage is re-counted from the held tokens."""
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
    """A fresh pool with ``declaration`` and nothing held."""
    state = PoolState()
    _declare(state, declaration)
    return state


def fold_all(envelopes: Iterable[Envelope]) -> PoolState:
    """Fold envelopes into a fresh state."""
    projection = PoolProjection()
    state = projection.initial()
    for env in envelopes:
        state = projection.evolve(state, env)
    return state
