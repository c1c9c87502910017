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
  ``rollout_log_probs``, over ``loss_mask``; with an off-policy :class:`Correction`
  (truncated or masked importance sampling, ICEPOP band) and, for decoupled PPO, the
  proximal logprobs :func:`proximal_log_probs` builds;
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

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "MIXED_TEACHER_SENTINEL",
    "Correction",
    "ImportanceWeights",
    "LossOutput",
    "ce_loss",
    "group_advantages",
    "grpo_loss",
    "importance_weights",
    "k3",
    "k3_loss",
    "mismatch_kl",
    "mixed_ce_k3_loss",
    "proximal_log_probs",
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


CORRECTION_MODES = ("none", "tis", "mis", "icepop")
"""``none``: no reweighting; ``tis``: truncated importance sampling; ``mis``: masked importance
sampling; ``icepop``: the ratio band (see :class:`Correction`)."""

CORRECTION_LEVELS = ("token", "sequence")

_MAX_LOG_WEIGHT = 20.0
"""An untruncated weight's log is capped here, so a sequence's product of ratios cannot
overflow float32 (``exp(20)`` is about 5e8: past any weight a trainer should use)."""


@dataclass(frozen=True)
class Correction:
    """How a policy-gradient term is reweighted when its tokens were sampled by another policy
    than the one its PPO ratio is anchored at (the sampler's numerics, older weights).

    With ``r = exp(target - behaviour)`` per token (``level="token"``) or its product over
    the sequence's masked tokens, broadcast to them (``level="sequence"``):

    * ``none`` -- weight ``r`` itself (capped at ``exp(20)``): plain importance sampling;
    * ``tis`` -- weight ``min(r, cap)``: truncated importance sampling (TIS);
    * ``mis`` -- weight ``r`` where ``r <= cap``; tokens (or, at sequence level, sequences)
      with ``r > cap`` leave the loss: masked importance sampling (MIS);
    * ``icepop`` -- weight ``r`` where ``band[0] <= r <= band[1]`` (edges kept), the rest
      leave the loss (ICEPOP's double-sided mask).

    ``cap >= 1`` and ``band[0] <= 1 <= band[1]``: a bound that cuts ``r = 1`` would reweight
    or drop tokens that are on-policy.
    """

    mode: str = "none"
    level: str = "token"
    cap: float = 2.0
    band: tuple[float, float] = (0.5, 5.0)

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"correction mode {self.mode!r}: expected one of {CORRECTION_MODES}")
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(
                f"correction level {self.level!r}: expected one of {CORRECTION_LEVELS}"
            )
        if not 1.0 <= self.cap < math.inf:
            raise ValueError(f"correction cap must be finite and >= 1, got {self.cap}")
        low, high = self.band
        if not 0.0 < low <= 1.0 <= high < math.inf:
            raise ValueError(
                f"correction band must satisfy 0 < low <= 1 <= high < inf, got {self.band}"
            )


@dataclass(frozen=True)
class ImportanceWeights:
    """What a :class:`Correction` makes of one batch, all ``[B, T]`` and detached.

    ``weights`` multiplies each token's policy-gradient term (0 off ``keep``); ``keep`` is the
    loss mask less the tokens the correction masks out (the token mean runs over it);
    ``metrics``: ``is_ess``, ``is_truncated``, ``is_masked`` (see :func:`importance_weights`).
    """

    weights: torch.Tensor
    keep: torch.Tensor
    metrics: dict[str, float]


def importance_weights(
    target_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    correction: Correction,
) -> ImportanceWeights:
    """The weights of ``correction`` for tokens sampled by the behaviour policy and trained
    as if from the target one (``[B, T]`` each; no gradient flows through either).

    Metrics, over the ``loss_mask`` tokens (``n`` of them):

    * ``is_ess`` -- the normalised effective sample size ``(sum w)^2 / (n * sum w^2)`` of the
      weights as applied (0 for a masked token): 1 when every weight is equal, towards
      ``1 / n`` when one token carries the batch; 1 for an empty mask;
    * ``is_truncated`` -- the share of tokens whose weight the cap lowered (``tis``);
    * ``is_masked`` -- the share of tokens taken out of the loss (``mis``, ``icepop``).

    The definitions follow verl (``verl/trainer/ppo/mismatch_helper.py``,
    ``compute_rollout_importance_weights``: token / sequence levels, truncate and mask modes),
    slime (``examples/train_infer_mismatch_helper/mis.py``, ``compute_mis_weights``) and TRL's
    GRPO (``vllm_importance_sampling_correction`` with ``vllm_importance_sampling_cap``);
    ICEPOP's band follows the Ring-1T report (mask, not clip, outside ``[0.5, 5]``).
    """
    _check_same_shape("behaviour_log_probs", behaviour_log_probs, target_log_probs)
    _check_same_shape("loss_mask", loss_mask, target_log_probs)
    with torch.no_grad():
        mask = loss_mask.to(torch.float32)
        on = mask > 0
        log_ratio = (target_log_probs.float() - behaviour_log_probs.float()) * mask
        if correction.level == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(mask)
        if correction.mode == "tis":
            log_cap = math.log(correction.cap)
            truncated = on & (log_ratio > log_cap)
            dropped = torch.zeros_like(on)
            log_weight = log_ratio.clamp(max=log_cap)
        else:
            truncated = torch.zeros_like(on)
            if correction.mode == "mis":
                dropped = on & (log_ratio > math.log(correction.cap))
            elif correction.mode == "icepop":
                low, high = (math.log(b) for b in correction.band)
                dropped = on & ((log_ratio < low) | (log_ratio > high))
            else:
                dropped = torch.zeros_like(on)
            log_weight = log_ratio.clamp(max=_MAX_LOG_WEIGHT)
        keep = mask * (~dropped).to(mask.dtype)
        weights = torch.exp(log_weight) * keep
        n = float(mask.sum())
        w = weights.double()
        square = float((w * w).sum())
        ess = 1.0 if n == 0 else (float(w.sum()) ** 2 / (n * square) if square > 0 else 0.0)
        metrics = {
            "is_ess": ess,
            "is_truncated": float(truncated.sum()) / max(n, 1.0),
            "is_masked": float(dropped.sum()) / max(n, 1.0),
        }
    return ImportanceWeights(weights.to(target_log_probs.dtype), keep, metrics)


def proximal_log_probs(
    recomputed_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    token_versions: torch.Tensor,
    proximal_version: int,
) -> torch.Tensor:
    """Decoupled PPO's proximal policy, per token (``[B, T]``, detached).

    ``recomputed_log_probs`` is the trainer's logprob of each token under the weights it holds
    before the update (version ``proximal_version``), computed without gradient;
    ``token_versions`` (``collate``'s) the weight version that sampled each token. A token
    sampled at ``proximal_version`` was drawn by the proximal policy itself: behaviour and
    proximal are one policy there, so its rollout logprob is used (ratio 1 by construction).
    Every other token (older versions, unknown ``-1``) takes the recomputed value.
    """
    _check_same_shape("rollout_log_probs", rollout_log_probs, recomputed_log_probs)
    _check_same_shape("token_versions", token_versions, recomputed_log_probs)
    same = token_versions == proximal_version
    return torch.where(
        same, rollout_log_probs.to(recomputed_log_probs.dtype), recomputed_log_probs
    ).detach()


def mismatch_kl(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor
) -> float:
    """K3 estimate of KL(sampler || trainer) on the sampler's tokens: the token mean over
    ``mask`` of ``exp(d) - d - 1`` with ``d = log_probs - rollout_log_probs`` (never
    negative, 0 where they agree; unbiased since the sampler drew the tokens). The same
    estimator verl and slime log as ``mismatch_k3_kl`` / ``k3_kl``."""
    with torch.no_grad():
        return float(token_mean(k3(rollout_log_probs.to(log_probs.dtype), log_probs.detach()),
                                mask))


def _per_token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(
                f"advantages has {advantages.shape[0]} rows, log_probs {like.shape[0]}"
            )
        advantages = advantages[:, None].expand_as(like)
    _check_same_shape("advantages", advantages, like)
    return advantages.to(like.dtype)


def grpo_loss(
    log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    correction: Correction | None = None,
    proximal: torch.Tensor | None = None,
) -> LossOutput:
    """PPO's clipped surrogate with per-sample advantages, token mean over ``loss_mask``.

    Per token ``-min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)`` with ``A``
    the sample's advantage (``[B]``, e.g. :func:`group_advantages`, or ``[B, T]``) and
    ``ratio = exp(log_probs - anchor)``. Without ``proximal`` and with no correction (or
    ``mode="none"``) the anchor is ``rollout_log_probs``: the sampler is the behaviour policy.

    Otherwise the anchor is the proximal policy -- ``proximal`` when given (decoupled PPO:
    :func:`proximal_log_probs`), else ``log_probs.detach()`` (the trainer's own policy at its
    first step on the batch) -- and each token's term is multiplied by the detached weight
    ``correction`` makes of ``exp(anchor - rollout_log_probs)`` (:func:`importance_weights`;
    ``none`` leaves that weight untruncated); tokens it masks leave the token mean. The
    decoupled form follows AReaL (``areal/utils/functional.py``, ``ppo_actor_loss_fn``:
    clip against the proximal policy, behaviour/proximal weight capped by
    ``behav_imp_weight_cap``).

    Metrics: ``clip_frac`` (kept tokens whose ratio was clipped), ``approx_kl`` (token mean of
    ``rollout_log_probs - log_probs``), ``mismatch_kl`` (:func:`mismatch_kl`, trainer vs
    sampler), the correction's ``is_ess``, ``is_truncated``, ``is_masked`` (for the plain
    loss: those of untruncated weights, which it does not apply), ``tokens``.
    """
    _check_same_shape("rollout_log_probs", rollout_log_probs, log_probs)
    _check_same_shape("loss_mask", loss_mask, log_probs)
    adv = _per_token_advantages(advantages, log_probs)
    correction = correction or Correction()
    plain = proximal is None and correction.mode == "none"
    rollout = rollout_log_probs.to(log_probs.dtype)
    anchor = log_probs.detach() if proximal is None else proximal.to(log_probs.dtype).detach()
    _check_same_shape("proximal", anchor, log_probs)
    iw = importance_weights(anchor, rollout, loss_mask, correction)
    if plain:
        anchor, mask = rollout, loss_mask.to(log_probs.dtype)
    else:
        mask = iw.keep.to(log_probs.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(log_probs - anchor)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    if not plain:
        per_token = per_token * iw.weights
    loss = token_mean(per_token, mask)
    with torch.no_grad():
        was_clipped = (ratio * adv > clipped * adv).to(log_probs.dtype)
        metrics = {
            "pg_loss": float(loss),
            "clip_frac": float(token_mean(was_clipped, mask)),
            "approx_kl": float(token_mean(rollout - log_probs, loss_mask)),
            "mismatch_kl": mismatch_kl(log_probs, rollout, loss_mask),
            **iw.metrics,
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
