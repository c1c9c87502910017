"""Events of ``rl:pool``: the cluster layout and the placement tokens of batches."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.events.base import Event
from engine.events.catalog.records import Record


class NodeDecl(Record):
    node: str
    gpus: list[int] = Field(default_factory=list)
    cpu: float = 0.0
    memory_gb: float = 0.0


class GpuShare(Record):
    gpu: int
    fraction: float


class TokenGrant(Record):
    """One placement token: what one running sample may hold on one node."""

    token_id: str
    node: str
    gpus: list[GpuShare] = Field(default_factory=list)
    cpu: float = 0.0
    memory_gb: float = 0.0


class PoolDeclared(Event):
    """The cluster layout; a later declaration replaces the earlier one."""

    type: Literal["PoolDeclared"] = "PoolDeclared"
    nodes: list[NodeDecl]


class TokenAcquired(Event):
    """All-or-nothing placement of a whole batch (appended by compare-and-append)."""

    type: Literal["TokenAcquired"] = "TokenAcquired"
    rollout_id: str
    batch_id: str
    evaluator_id: str
    tokens: list[TokenGrant]


class TokenReleased(Event):
    """Tokens given back; ``token_ids`` None releases every token the batch still holds.

    ``lease`` is the releasing holder's claim on the batch: the delivery count of the work
    entry it ran the batch under (0: no lease recorded). The pool ignores a
    release whose lease is older than the batch's last ``BatchLeased`` (a late write of a
    holder the batch has moved on from)."""

    type: Literal["TokenReleased"] = "TokenReleased"
    rollout_id: str
    batch_id: str
    token_ids: list[str] | None = None
    reason: str = ""
    lease: int = 0


class BatchLeased(Event):
    """A worker took over a batch someone may already have run (a redelivery), under the
    work entry's delivery count ``lease``; appended to ``rl:pool`` before it decides what to
    re-run. From then on releases with an older lease are fenced off."""

    type: Literal["BatchLeased"] = "BatchLeased"
    rollout_id: str
    batch_id: str
    lease: int
    worker: str = ""


class AdmissionClosed(Event):
    """The scheduler admitted every batch of the rollout; appended to ``rl:pool`` after its
    last admission. A scheduler resuming the request admits nothing more, and the pool fold
    forgets the rollout's batches once they are released (its record of admitted batches
    no longer grows with every batch)."""

    type: Literal["AdmissionClosed"] = "AdmissionClosed"
    rollout_id: str
