"""Hand-built DAgger trajectories and folded rollouts for the lane tests.

A trajectory is written turn by turn: ``("t", n)`` a teacher-executed turn of ``n`` tokens
(``loss_mask`` 0, ``teacher_mask`` 1), ``("s", n)`` a student turn (``loss_mask`` 1, a cut
point at its first token) and ``("o", n)`` observation tokens (both masks 0). Token ids are
``100 + position`` so slices are easy to read back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.events import Envelope, Event, RolloutRequested, TaskFetched
from engine.events.catalog import RolloutPlanned, RolloutReady, SampleCompleted, TeacherScored
from engine.projections.base import fold, start
from engine.projections.readback import Rollout, in_memory
from engine.projections.rollout import RolloutProjection

Turn = tuple[str, int]

PROMPT = (1, 2, 3)


def completed(
    rollout_id: str, index: int, turns: Sequence[Turn], *, reward: float = 1.0
) -> SampleCompleted:
    loss: list[int] = []
    teacher: list[int] = []
    cuts: list[int] = []
    for kind, n in turns:
        if kind == "s":
            cuts.append(len(loss))
        loss += [1 if kind == "s" else 0] * n
        teacher += [1 if kind == "t" else 0] * n
    size = len(loss)
    return SampleCompleted(
        rollout_id=rollout_id,
        sample_id=f"{rollout_id}:s{index}",
        attempt=1,
        prompt_ids=PROMPT,
        response_ids=[100 + i for i in range(size)],
        logprobs=[-0.01 * (i + 1) for i in range(size)],
        loss_mask=loss,
        teacher_mask=teacher,
        student_cut_points=cuts,
        reward=reward,
        termination_reason="finish",
        n_turns=len([t for t in turns if t[0] != "o"]),
    )


def fetched(rollout_id: str, index: int, *, group: int | None = None) -> TaskFetched:
    return TaskFetched(
        rollout_id=rollout_id,
        sample_id=f"{rollout_id}:s{index}",
        index=index,
        group_index=index if group is None else group,
        prompt=f"prompt {index}",
        label="1",
        dataset="ds",
        task_type="dagger",
        source_line=index + 1,
    )


def request(rollout_id: str, algorithm: str, n: int, **fields: Any) -> RolloutRequested:
    return RolloutRequested(
        rollout_id=rollout_id, n_prompts=n, algorithm=algorithm, iteration=2, seed=7, **fields
    )


def scored(done: SampleCompleted, *, k: int = 2) -> TeacherScored:
    """Teacher logprob ``-(i + 1) / 10`` at position ``i``; top-K ids ``token + j``."""
    n = len(done.response_ids)
    ids = done.response_ids.tolist()
    return TeacherScored(
        rollout_id=done.rollout_id,
        sample_id=done.sample_id,
        attempt=done.attempt,
        teacher_logprobs=[-(i + 1) / 10 for i in range(n)],
        top_k=k,
        topk_ids=[t + j for t in ids for j in range(k)],
        topk_logprobs=[-(i + 1) / 10 - j for i in range(n) for j in range(k)],
    )


def state_of(
    req: RolloutRequested,
    trajectories: Sequence[Sequence[Turn] | None],
    *,
    teacher: bool = False,
    ready: Sequence[str] | None = None,
) -> Rollout:
    """A folded rollout with its entries at hand: the request, one sample per trajectory
    (None: a sample with no terminal event yet), the plan, the terminals, the teacher's
    scorings (``teacher``) and a ``RolloutReady`` naming ``ready``."""
    rid = req.rollout_id
    events: list[Event] = [req]
    events += [fetched(rid, i) for i in range(len(trajectories))]
    events.append(RolloutPlanned(rollout_id=rid, n_samples=len(trajectories), n_batches=1))
    for i, turns in enumerate(trajectories):
        if turns is not None:
            done = completed(rid, i, turns)
            events.append(done)
            if teacher:
                events.append(scored(done))
    if ready is not None:
        events.append(RolloutReady(rollout_id=rid, iteration=req.iteration,
                                   sample_ids=list(ready)))
    envs = [Envelope(f"rl:{{rollout:{rid}}}", f"{i + 1}-0", ev) for i, ev in enumerate(events)]
    projection = RolloutProjection()
    return in_memory(fold(projection, start(projection), envs).state, envs)
