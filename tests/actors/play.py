"""Plays the scheduler's part of the contract, so evaluator, finalizer and client can be
tested (and benchmarked) on their own.

The scheduler's contract toward the workers: on ``rl:{rollout:<id>}`` a copy of the
``RolloutRequested``, one ``TaskFetched`` per sample, one ``BatchSealed`` per batch, then
``RolloutPlanned``; per batch, atomically, ``TokenAcquired`` on ``rl:pool`` and
``BatchAdmitted`` on ``rl:work:{evaluator_id}``. This helper writes exactly those events,
for an arbitrary script per sample; it admits every batch at once (no placement pool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.errors import AppendConflict
from engine.events import (
    BatchAdmitted,
    BatchSealed,
    Event,
    EventLog,
    GpuShare,
    RolloutPlanned,
    RolloutRequested,
    TaskFetched,
    TokenAcquired,
    TokenGrant,
)

Script = Callable[[int], dict[str, Any]]


def _no_script(index: int) -> dict[str, Any]:
    return {}


def plan_events(
    request: RolloutRequested,
    *,
    evaluator_id: str = "scripted",
    batch_size: int = 4,
    tokens_per_batch: int | None = None,
    nodes: tuple[str, ...] = ("node-a", "node-b"),
    script: Script = _no_script,
    datasets: tuple[str, ...] = ("ds",),
    stopping: dict[str, Any] | None = None,
) -> tuple[list[Event], list[tuple[TokenAcquired, BatchAdmitted]]]:
    """The rollout-stream events and the per-batch admissions of a plan.

    Samples are ``n_prompts * n_samples_per_prompt``; prompt ``p`` belongs to dataset
    ``datasets[p % len(datasets)]`` and its samples share group ``p``.
    """
    rid = request.rollout_id
    per_prompt = request.n_samples_per_prompt or 1
    fetched: list[TaskFetched] = []
    for p in range(request.n_prompts):
        dataset = datasets[p % len(datasets)]
        for c in range(per_prompt):
            index = p * per_prompt + c
            fetched.append(
                TaskFetched(
                    rollout_id=rid,
                    sample_id=f"{rid}:s{index}",
                    index=index,
                    group_index=p,
                    prompt=f"prompt {p}",
                    label=f"label {p}",
                    dataset=dataset,
                    task_type=evaluator_id,
                    source_line=p + 1,
                    metadata={"script": script(index)},
                    stopping=dict(stopping or {}),
                )
            )
    sealed: list[BatchSealed] = []
    admissions: list[tuple[TokenAcquired, BatchAdmitted]] = []
    for seq, start in enumerate(range(0, len(fetched), batch_size)):
        ids = [t.sample_id for t in fetched[start : start + batch_size]]
        batch_id = f"{rid}:b{start}"
        sealed.append(
            BatchSealed(
                rollout_id=rid,
                batch_id=batch_id,
                seq=seq,
                evaluator_id=evaluator_id,
                sample_ids=ids,
            )
        )
        n_tokens = len(ids) if tokens_per_batch is None else min(tokens_per_batch, len(ids))
        grants = [
            TokenGrant(
                token_id=f"{batch_id}:t{k}",
                node=nodes[k % len(nodes)],
                gpus=[GpuShare(gpu=k % 2, fraction=0.25)],
                cpu=1.0,
            )
            for k in range(n_tokens)
        ]
        admissions.append(
            (
                TokenAcquired(
                    rollout_id=rid, batch_id=batch_id, evaluator_id=evaluator_id, tokens=grants
                ),
                BatchAdmitted(
                    rollout_id=rid,
                    batch_id=batch_id,
                    evaluator_id=evaluator_id,
                    sample_ids=ids,
                    token_ids=[g.token_id for g in grants],
                    nodes={g.token_id: g.node for g in grants},
                    gpus={g.token_id: [s.gpu for s in g.gpus] for g in grants},
                ),
            )
        )
    planned = RolloutPlanned(
        rollout_id=rid,
        n_samples=len(fetched),
        n_batches=len(sealed),
        batch_ids=[b.batch_id for b in sealed],
    )
    return [request, *fetched, *sealed, planned], admissions


async def play_scheduler(log: EventLog, request: RolloutRequested, **kwargs: Any) -> int:
    """Write the plan and admit every batch; returns the number of samples."""
    events, admissions = plan_events(request, **kwargs)
    stream = log.names.rollout(request.rollout_id)
    for start in range(0, len(events), 1000):
        await log.append_many([(stream, ev) for ev in events[start : start + 1000]])
    for acquired, admitted in admissions:
        while True:  # workers release tokens on the pool meanwhile: retry on conflict
            try:
                await log.append_if_last(
                    log.names.pool,
                    acquired,
                    await log.last_id(log.names.pool),
                    also=[(log.names.work(admitted.evaluator_id), admitted)],
                )
                break
            except AppendConflict:
                continue
    return sum(1 for ev in events if isinstance(ev, TaskFetched))
