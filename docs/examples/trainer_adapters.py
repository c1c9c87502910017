"""From ``collate``'s right-padded batch to the layouts other trainers use (docs/trainers.md).

``collate(samples)`` gives whole sequences, right-padded: row i holds prompt + response in
positions ``0 .. prompt_lengths[i] + response_lengths[i]``. verl and TRL keep the prompt and
the response apart: prompts left-padded to one width, responses right-padded to another.
tests/ops/test_docs_examples.py checks these against hand-built samples.

``off_policy_grpo_loss`` shows how such a loop calls the engine's off-policy corrections
(``engine.losses``, docs/trainers.md "Off-policy corrections") on the response layout;
tests/test_losses.py checks it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.losses import Correction, LossOutput, grpo_loss, proximal_log_probs
from engine.sample import Sample

TRL_IMPORTANCE_SAMPLING_MODES = {
    "token_truncate": Correction("tis", level="token"),
    "token_mask": Correction("mis", level="token"),
    "sequence_truncate": Correction("tis", level="sequence"),
    "sequence_mask": Correction("mis", level="sequence"),
}
"""TRL GRPO's ``vllm_importance_sampling_mode`` as a ``Correction`` (its
``vllm_importance_sampling_cap`` is ``cap``: ``dataclasses.replace(c, cap=...)``)."""


def split_prompt_response(
    batch: dict[str, torch.Tensor], pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """Prompts left-padded (``prompt_ids``, ``prompt_mask``) and responses right-padded
    (``response_ids``, ``response_mask`` = the loss mask, ``response_log_probs``,
    ``response_versions`` = the weight version of each sampled token, -1 elsewhere)."""
    tokens = batch["tokens"]
    plen, rlen = batch["prompt_lengths"], batch["response_lengths"]
    n, p_width, r_width = tokens.shape[0], int(plen.max()), int(rlen.max())
    prompt_ids = torch.full((n, p_width), pad_token_id, dtype=tokens.dtype)
    prompt_mask = torch.zeros((n, p_width), dtype=torch.int64)
    response_ids = torch.full((n, r_width), pad_token_id, dtype=tokens.dtype)
    response_mask = torch.zeros((n, r_width), dtype=batch["loss_mask"].dtype)
    response_log_probs = torch.zeros((n, r_width), dtype=batch["rollout_log_probs"].dtype)
    response_versions = torch.full((n, r_width), -1, dtype=batch["token_versions"].dtype)
    for i in range(n):
        p, r = int(plen[i]), int(rlen[i])
        prompt_ids[i, p_width - p :] = tokens[i, :p]
        prompt_mask[i, p_width - p :] = 1
        response_ids[i, :r] = tokens[i, p : p + r]
        response_mask[i, :r] = batch["loss_mask"][i, p : p + r]
        response_log_probs[i, :r] = batch["rollout_log_probs"][i, p : p + r]
        response_versions[i, :r] = batch["token_versions"][i, p : p + r]
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "response_log_probs": response_log_probs,
        "response_versions": response_versions,
    }


def to_verl(batch: dict[str, torch.Tensor], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of a verl-style ``DataProto`` batch: ``prompts``, ``responses``,
    ``input_ids`` (= prompts then responses), ``attention_mask``, ``position_ids``,
    ``response_mask``, ``rollout_log_probs`` and ``token_level_scores`` (the reward on each
    response's last token)."""
    parts = split_prompt_response(batch, pad_token_id)
    response_valid = (
        torch.arange(parts["response_ids"].shape[1])[None, :] < batch["response_lengths"][:, None]
    ).to(torch.int64)
    attention = torch.cat([parts["prompt_mask"], response_valid], dim=1)
    scores = torch.zeros(parts["response_ids"].shape, dtype=torch.float32)
    last = (batch["response_lengths"] - 1).clamp(min=0)
    has_response = batch["response_lengths"] > 0
    rows = torch.arange(scores.shape[0])[has_response]
    scores[rows, last[has_response]] = batch["rewards"][has_response]
    return {
        "prompts": parts["prompt_ids"],
        "responses": parts["response_ids"],
        "input_ids": torch.cat([parts["prompt_ids"], parts["response_ids"]], dim=1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(dim=1) - 1).clamp(min=0),
        "response_mask": parts["response_mask"] * response_valid,
        "rollout_log_probs": parts["response_log_probs"],
        "token_level_scores": scores,
    }


def group_advantages(samples: Sequence[Sample], rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (samples of
    one prompt share ``group_index``); a group with one sample, or all equal, gets 0."""
    groups = torch.tensor([s.group_index for s in samples])
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        member = groups == g
        r = rewards[member]
        std = r.std() if r.numel() > 1 else torch.tensor(0.0)
        out[member] = (r - r.mean()) / std if std > 0 else 0.0
    return out


def to_trl(
    samples: Sequence[Sample], batch: dict[str, torch.Tensor], pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """The inputs a TRL-style GRPO loss takes: ``prompt_ids`` / ``prompt_mask`` (left-padded),
    ``completion_ids`` / ``completion_mask`` (right-padded; the loss mask, so tool output is
    not trained on), ``old_per_token_logps`` (the sampler's) and ``advantages``. Samples with
    ``remove_sample`` get an all-zero mask."""
    parts = split_prompt_response(batch, pad_token_id)
    keep = (~batch["remove_sample"]).to(parts["response_mask"].dtype)[:, None]
    return {
        "prompt_ids": parts["prompt_ids"],
        "prompt_mask": parts["prompt_mask"],
        "completion_ids": parts["response_ids"],
        "completion_mask": parts["response_mask"] * keep,
        "old_per_token_logps": parts["response_log_probs"],
        "advantages": group_advantages(samples, batch["rewards"]),
    }


def off_policy_grpo_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    correction: Correction,
    versions: torch.Tensor | None = None,
    proximal_version: int = 0,
    clip_eps: float = 0.2,
) -> LossOutput:
    """A TRL/verl-style loop's corrected GRPO loss, all ``[B, R]`` on the response layout.

    ``per_token_logps``: the policy being updated, with gradient (TRL's ``per_token_logps``,
    verl's ``log_prob``). ``old_per_token_logps``: the trainer's logprobs under the weights it
    held before the update, computed without gradient (TRL's ``old_per_token_logps``, verl's
    ``old_log_prob``): the PPO clip is taken against them. ``sampling_per_token_logps``: the
    sampler's, the engine's ``rollout_log_probs`` (TRL's ``sampling_per_token_logps``, verl's
    ``rollout_log_probs``): the weight is ``correction`` of old / sampler. With ``versions``
    (``response_versions`` of ``split_prompt_response``) it is decoupled PPO: tokens sampled
    at ``proximal_version`` take the sampler's logprob as the proximal one.
    """
    proximal = old_per_token_logps
    if versions is not None:
        proximal = proximal_log_probs(old_per_token_logps, sampling_per_token_logps, versions,
                                      proximal_version)
    return grpo_loss(per_token_logps, sampling_per_token_logps, advantages, completion_mask,
                     clip_eps=clip_eps, correction=correction, proximal=proximal)
