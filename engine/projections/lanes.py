"""Trajectory post-processing lanes: how a finished rollout's samples are shaped for the loss.

The request's ``algorithm`` alone picks the lane (:func:`lane_of`); samples are filtered (by
the finalizer), then shaped here. Every function is pure, so the finalizer, the trainer's
``load`` and ``rollout replay`` shape a rollout the same way, byte for byte.

``plain`` (``grpo``, ``ppo`` and any other name)
    Samples as the episodes recorded them (a request setting ``teacher_capture`` itself gets
    the ``per_token`` shaping of its scored samples).
``per_token`` (``opd``, ``k3``, ``distill``)
    Every kept completed sample is force-decoded on the teacher with top-K (``TeacherScored``)
    and carries the teacher's logprob of each response token, its top-K, the action mask (the
    tokens the student emitted) and the is-teacher mask; its ``loss_mask`` *is* the action
    mask, so the K3 loss reduces over student actions only.
``mixed`` (``mixed_ce_k3``, ``dagger_k3``)
    As ``per_token``, and the teacher's positions get :data:`TEACHER_SENTINEL` (+1.0) in
    ``teacher_log_probs``: real logprobs are <= 0, so the mixed kernel reads the sign (> 0 CE
    on a teacher token, <= 0 K3 on a student token). ``loss_mask`` is action *or* is-teacher.
``ce`` (``dagger_ce``, ``dagger_sft``)
    No teacher capture. Each kept DAgger trajectory is expanded into SFT sub-samples at its
    student cut points (:func:`ce_chunks`); a trajectory with a sub-sample over
    ``knobs["max_seq_len"]`` is dropped whole; sub-samples are shuffled deterministically per
    iteration (:func:`ce_order`); ``RolloutReady.gbs_scale`` is the mean number of sub-samples
    per trajectory, which keeps tasks per optimizer step constant as chunks multiply.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np

from engine.errors import ConfigError
from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.events.catalog import RolloutRequested, SampleCompleted, TeacherScored

__all__ = [
    "CE_ALGORITHMS",
    "MIXED_ALGORITHMS",
    "PER_TOKEN_ALGORITHMS",
    "TEACHER_SENTINEL",
    "CeChunk",
    "CePlan",
    "Lane",
    "TeacherShape",
    "ce_chunks",
    "ce_order",
    "plan_ce",
    "action_mask_of",
    "lane_of",
    "max_seq_len_of",
    "needs_teacher",
    "request_lane",
    "teacher_shape",
]

TEACHER_SENTINEL = 1.0
"""Written into ``teacher_log_probs`` at teacher positions by the mixed lane (> 0: CE)."""

PER_TOKEN_ALGORITHMS = frozenset({"opd", "k3", "distill"})
MIXED_ALGORITHMS = frozenset({"mixed_ce_k3", "dagger_k3"})
CE_ALGORITHMS = frozenset({"dagger_ce", "dagger_sft"})


class Lane(StrEnum):
    PLAIN = "plain"
    PER_TOKEN = "per_token"
    MIXED = "mixed"
    CE = "ce"


def lane_of(algorithm: str) -> Lane:
    if algorithm in PER_TOKEN_ALGORITHMS:
        return Lane.PER_TOKEN
    if algorithm in MIXED_ALGORITHMS:
        return Lane.MIXED
    if algorithm in CE_ALGORITHMS:
        return Lane.CE
    return Lane.PLAIN


def request_lane(request: RolloutRequested | None) -> Lane:
    return lane_of(request.algorithm) if request is not None else Lane.PLAIN


def needs_teacher(request: RolloutRequested | None) -> bool:
    """Whether kept samples are force-decoded on the teacher (never in the CE lane)."""
    if request is None:
        return False
    lane = request_lane(request)
    if lane is Lane.CE:
        return False
    return lane in (Lane.PER_TOKEN, Lane.MIXED) or request.teacher_capture


# ---------------------------------------------------------------- per-token lanes


@dataclass(frozen=True, slots=True)
class TeacherShape:
    """The per-token fields of one scored sample, one entry per response token (top-K rows
    flattened row-major, ``top_k`` per position; ``top_k`` 0 when none came back)."""

    teacher_log_probs: LogProbs
    loss_mask: Mask
    action_mask: Mask
    is_teacher_mask: Mask
    top_k: int
    topk_ids: TokenIds | None
    topk_log_probs: LogProbs | None


def _teacher_mask(done: SampleCompleted) -> np.ndarray[Any, Any]:
    n = len(done.response_ids)
    if len(done.teacher_mask) == n:
        return done.teacher_mask.numpy().astype(bool)
    return np.zeros(n, dtype=bool)


def action_mask_of(done: SampleCompleted) -> Mask:
    """Student action tokens only: the loss mask without any teacher position."""
    student = done.loss_mask.numpy().astype(bool) & ~_teacher_mask(done)
    return Mask.from_values(student.astype(np.uint8))


def teacher_shape(done: SampleCompleted, scored: TeacherScored, lane: Lane) -> TeacherShape:
    """The per-token shaping of a completed sample (any ``lane`` but ``mixed`` shapes as
    ``per_token``); raises ``ValueError`` if the scoring does not cover the response."""
    n = len(done.response_ids)
    if len(scored.teacher_logprobs) != n:
        raise ValueError(
            f"sample {done.sample_id}: TeacherScored has {len(scored.teacher_logprobs)} "
            f"logprobs for {n} response tokens"
        )
    is_teacher = _teacher_mask(done)
    action = (
        scored.action_mask if len(scored.action_mask) == n else action_mask_of(done)
    )
    teacher_lps = scored.teacher_logprobs
    loss = action
    if lane is Lane.MIXED:
        values = np.where(is_teacher, np.float32(TEACHER_SENTINEL), teacher_lps.numpy())
        teacher_lps = LogProbs.from_values(values.astype(np.float32))
        loss = Mask.from_values((action.numpy().astype(bool) | is_teacher).astype(np.uint8))
    rows = len(scored.topk_ids)
    k = scored.top_k if rows == scored.top_k * n == len(scored.topk_logprobs) else 0
    return TeacherShape(
        teacher_log_probs=teacher_lps,
        loss_mask=loss,
        action_mask=action,
        is_teacher_mask=Mask.from_values(is_teacher.astype(np.uint8)),
        top_k=k,
        topk_ids=scored.topk_ids if k else None,
        topk_log_probs=scored.topk_logprobs if k else None,
    )


# ---------------------------------------------------------------- the CE lane


@dataclass(frozen=True, slots=True)
class CeChunk:
    """One SFT sub-sample of a trajectory: the first ``end`` response tokens, trained (CE) on
    the teacher's tokens in ``[start, end)``."""

    sample_id: str
    chunk: int
    start: int
    end: int
    n_tokens: int  # prompt + the first ``end`` response tokens


def ce_chunks(done: SampleCompleted) -> list[CeChunk]:
    """A trajectory's SFT sub-samples, in order.

    The student cut points (where each student turn begins) split the response into
    segments; segment ``j`` with at least one teacher token gives sub-sample ``j``: the
    prompt and the response up to that last teacher token, CE on the segment's teacher
    tokens only (everything earlier is context).
    """
    n = len(done.response_ids)
    teacher = _teacher_mask(done)
    cuts = [c for c in done.student_cut_points if 0 < c < n]
    bounds = [0, *cuts, n]
    prompt = len(done.prompt_ids)
    out: list[CeChunk] = []
    for j in range(len(bounds) - 1):
        start, stop = bounds[j], bounds[j + 1]
        hits = np.flatnonzero(teacher[start:stop])
        if not len(hits):
            continue
        end = start + int(hits[-1]) + 1
        out.append(
            CeChunk(
                sample_id=done.sample_id, chunk=j, start=start, end=end, n_tokens=prompt + end
            )
        )
    return out


def max_seq_len_of(request: RolloutRequested | None) -> int | None:
    """``knobs["max_seq_len"]``: the CE lane's longest sub-sample (tokens); None: no limit."""
    if request is None:
        return None
    value = request.knobs.get("max_seq_len")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"rollout {request.rollout_id}: knobs['max_seq_len'] must be a positive integer, "
            f"got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True)
class CePlan:
    """The CE lane's decision over the filtered samples: the chunks of the trajectories kept
    (in training order, shuffled), the ids dropped whole because a chunk was too long, and
    the global-batch-size scaling."""

    chunks: tuple[CeChunk, ...]
    too_long: tuple[str, ...]
    n_trajectories: int  # kept trajectories that gave at least one chunk

    @property
    def gbs_scale(self) -> float:
        return len(self.chunks) / self.n_trajectories if self.n_trajectories else 1.0


def ce_order(chunks: Iterable[CeChunk], *, seed: int, iteration: int) -> list[CeChunk]:
    """``chunks`` sorted by a hash of seed, iteration and chunk identity: sibling chunks are
    de-clustered, and the order is the same on every machine and replay."""

    def key(c: CeChunk) -> bytes:
        text = f"ce\0{seed}\0{iteration}\0{c.sample_id}\0{c.chunk}"
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    return sorted(chunks, key=key)


def plan_ce(
    request: RolloutRequested | None, trajectories: Iterable[tuple[str, Sequence[CeChunk]]]
) -> CePlan:
    """The CE plan of ``(sample id, chunks)`` trajectories in kept order; the one rule the
    loader and the finalizer both use."""
    limit = max_seq_len_of(request)
    chunks: list[CeChunk] = []
    too_long: list[str] = []
    n_traj = 0
    for sid, mine in trajectories:
        if limit is not None and any(c.n_tokens > limit for c in mine):
            too_long.append(sid)
            continue
        if mine:
            n_traj += 1
            chunks.extend(mine)
    seed = request.seed if request is not None else 0
    iteration = request.iteration if request is not None else 0
    ordered = ce_order(chunks, seed=seed, iteration=iteration)
    return CePlan(chunks=tuple(ordered), too_long=tuple(too_long), n_trajectories=n_traj)
