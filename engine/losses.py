"""Reference losses for the tensors ``collate`` builds, one per lane.

Pure torch, no engine imports: a trainer may copy this module as it is. Every loss takes
``[B, T]`` tensors in ``collate``'s layout (one row per sample, prompt + response, prompt
and padding positions masked out) and reduces by the **token mean** over its mask: the sum
over every masked position of the batch divided by the number of those positions (at least
one, so an all-masked batch gives a zero loss with zero gradient instead of NaN).

``log_probs`` is always the trained model's log-probability of ``tokens[b, t]`` at position
``t`` (from the logits at ``t - 1``; :func:`token_log_probs` computes it), with gradient.

Lanes and their losses (docs/trainers.md, "Losses"):

* ``grpo`` -- :func:`grpo_loss`: group-normalized advantages from ``rewards``
  (:func:`group_advantages`), PPO clipped ratio of ``log_probs`` against
  ``rollout_log_probs``, over ``loss_mask``;
* ``opd`` / ``k3`` -- :func:`k3_loss`: the K3 estimator of the reverse KL(student || teacher)
  on the sampled tokens, ``exp(t - s) - (t - s) - 1``, over ``action_mask``;
* ``mixed_ce_k3`` -- :func:`mixed_ce_k3_loss`: per position, CE where ``teacher_log_probs``
  holds the lane's ``+1.0`` sentinel (a teacher token; real logprobs are ``<= 0``), K3
  elsewhere;
* the CE-only (trajectory-SFT) lane -- :func:`ce_loss`: negative log-likelihood over
  ``loss_mask``.

Each returns a :class:`LossOutput`: the scalar loss to ``backward()`` and detached float
metrics for logging.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "MIXED_TEACHER_SENTINEL",
    "LossOutput",
    "ce_loss",
    "group_advantages",
    "grpo_loss",
    "k3",
    "k3_loss",
    "mixed_ce_k3_loss",
    "token_log_probs",
    "token_mean",
]

MIXED_TEACHER_SENTINEL = 1.0
"""What the mixed lane writes into ``teacher_log_probs`` at teacher positions. Any value
``> 0`` is read as "CE here"; a real logprob is never positive."""


@dataclass(frozen=True)
class LossOutput:
    """A loss to ``backward()`` and what to log about it (plain floats, no graph)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _check_same_shape(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)}, expected {tuple(like.shape)} "
            "(the log_probs' [B, T])"
        )


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over the masked positions divided by their count (at least 1)."""
    _check_same_shape("mask", mask, values)
    weights = mask.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1.0)


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, *, vocab_size: int | None = None
) -> torch.Tensor:
    """``[B, T]`` logprob of ``tokens[b, t]`` under ``logits[b, t - 1]``; position 0 is 0.

    ``logits`` is the model's ``[B, T, V]`` output on ``tokens`` (``[B, T]``), so the result
    lines up with ``collate``'s ``loss_mask`` and ``rollout_log_probs``. ``vocab_size`` cuts
    the logits to the ids the tokenizer has before the softmax: checkpoints pad their
    embedding rows, and a server that never samples the spare ids (SGLang, tinylm) normalizes
    over the real ones only, so without the cut every logprob is off by the spare rows' mass.
    """
    if logits.dim() != 3 or logits.shape[:2] != tokens.shape:
        raise ValueError(
            f"logits must be [B, T, V] over tokens {tuple(tokens.shape)}, "
            f"got {tuple(logits.shape)}"
        )
    if vocab_size is not None:
        if not 0 < vocab_size <= logits.shape[-1]:
            raise ValueError(f"vocab_size must be in [1, {logits.shape[-1]}], got {vocab_size}")
        logits = logits[..., :vocab_size]
    shifted = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = shifted.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0), value=0.0)


def group_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages: each sample's reward minus its group's mean reward, divided by the
    group's standard deviation (population, ``+ eps``) when ``scale_by_std``.

    ``groups`` (``[B]`` int) names each sample's group (``Sample.group_index``). Rows where
    ``valid`` is False (aborted or removed samples) take no part in their group's statistics
    and get advantage 0. A group whose rewards are all equal gets 0 everywhere: it carries no
    signal.
    """
    if rewards.dim() != 1 or groups.shape != rewards.shape:
        raise ValueError(
            f"rewards and groups must both be [B], got {tuple(rewards.shape)} and "
            f"{tuple(groups.shape)}"
        )
    keep = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    if keep.shape != rewards.shape:
        raise ValueError(f"valid must be [B] like rewards, got {tuple(keep.shape)}")
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for group in torch.unique(groups):
        members = (groups == group) & keep
        if not bool(members.any()):
            continue
        values = rewards[members]
        centered = values - values.mean()
        if scale_by_std:
            centered = centered / (values.std(unbiased=False) + eps)
        out[members] = centered
    return out


def grpo_loss(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
) -> LossOutput:
    """PPO's clipped surrogate with per-sample advantages, token mean over ``loss_mask``.

    ``ratio = exp(log_probs - rollout_log_probs)`` (the sampler's logprobs are the behaviour
    policy); per token ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)``
    with ``A`` the sample's advantage (``[B]``, e.g. :func:`group_advantages`, or ``[B, T]``).
    Metrics: ``clip_frac`` (masked tokens whose ratio was clipped), ``approx_kl`` (token mean
    of ``rollout_log_probs - log_probs``, the sampler-vs-trainer mismatch on the first step).
    """
    _check_same_shape("rollout_log_probs", rollout_log_probs, log_probs)
    _check_same_shape("loss_mask", loss_mask, log_probs)
    if advantages.dim() == 1:
        if advantages.shape[0] != log_probs.shape[0]:
            raise ValueError(
                f"advantages has {advantages.shape[0]} rows, log_probs {log_probs.shape[0]}"
            )
        advantages = advantages[:, None].expand_as(log_probs)
    _check_same_shape("advantages", advantages, log_probs)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = log_probs - rollout_log_probs.to(log_probs.dtype)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    adv = advantages.to(log_probs.dtype)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    loss = token_mean(per_token, loss_mask)
    with torch.no_grad():
        was_clipped = (ratio * adv > clipped * adv).to(log_probs.dtype)
        metrics = {
            "pg_loss": float(loss),
            "clip_frac": float(token_mean(was_clipped, loss_mask)),
            "approx_kl": float(token_mean(-log_ratio, loss_mask)),
            "tokens": float(loss_mask.sum()),
        }
    return LossOutput(loss, metrics)


def k3(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token K3 estimate of KL(student || teacher) on tokens the student sampled:
    with ``d = teacher - student``, ``exp(d) - d - 1`` (never negative, 0 where they agree)."""
    d = teacher_log_probs.to(log_probs.dtype) - log_probs
    return torch.exp(d) - d - 1.0


def k3_loss(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, action_mask: torch.Tensor
) -> LossOutput:
    """On-policy distillation: the token mean of :func:`k3` over ``action_mask`` (the
    student's own action tokens), differentiated through ``log_probs`` only: the teacher's
    logprobs are data. Its gradient, ``(1 - exp(t - s)) * grad s`` per token, raises the
    student's logprob where the teacher's is higher and lowers it where it is lower; over
    tokens the student sampled its expectation is ``-grad E_teacher[log p_student]`` (the
    forward KL's, weighted by the unbounded ``q / p``). Metric ``kl``: the loss's value, an
    estimate of the reverse KL."""
    _check_same_shape("teacher_log_probs", teacher_log_probs, log_probs)
    _check_same_shape("action_mask", action_mask, log_probs)
    loss = token_mean(k3(log_probs, teacher_log_probs), action_mask)
    return LossOutput(loss, {"kl": float(loss.detach()), "tokens": float(action_mask.sum())})


def mixed_ce_k3_loss(
    log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, mask: torch.Tensor
) -> LossOutput:
    """The mixed CE/K3 kernel: reads the sign of ``teacher_log_probs`` per position.

    ``> 0`` (the lane's ``+1.0`` sentinel: a token the teacher produced) -> CE,
    ``-log_probs``; ``<= 0`` (a real teacher logprob of a student token) -> :func:`k3`. One
    token mean over ``mask`` (for the mixed lane: ``action_mask`` or ``is_teacher_mask``),
    so beta = 1 is pure CE and beta = 0 pure K3 (OPD). Metrics: ``ce`` and ``kl`` (each
    over its own positions), ``ce_tokens``, ``k3_tokens``.
    """
    _check_same_shape("teacher_log_probs", teacher_log_probs, log_probs)
    _check_same_shape("mask", mask, log_probs)
    is_ce = teacher_log_probs > 0
    # The sentinel is not a logprob: K3 of it, exp(1 - s), overflows for a small s, and
    # torch.where would back-propagate 0 * inf = NaN from the branch it discards.
    real_teacher = torch.where(is_ce, log_probs.detach(), teacher_log_probs.to(log_probs.dtype))
    per_token = torch.where(is_ce, -log_probs, k3(log_probs, real_teacher))
    loss = token_mean(per_token, mask)
    with torch.no_grad():
        weights = mask.to(log_probs.dtype)
        ce_mask = weights * is_ce.to(log_probs.dtype)
        k3_mask = weights - ce_mask
        metrics = {
            "ce": float(token_mean(per_token, ce_mask)),
            "kl": float(token_mean(per_token, k3_mask)),
            "ce_tokens": float(ce_mask.sum()),
            "k3_tokens": float(k3_mask.sum()),
        }
    return LossOutput(loss, metrics)


def ce_loss(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> LossOutput:
    """Supervised fine-tuning on the CE-only lane's sub-samples: the token mean of
    ``-log_probs`` over ``loss_mask``. Metric ``ce``: the loss's value."""
    _check_same_shape("loss_mask", loss_mask, log_probs)
    loss = token_mean(-log_probs, loss_mask)
    return LossOutput(loss, {"ce": float(loss.detach()), "tokens": float(loss_mask.sum())})
