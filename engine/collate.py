"""``collate``: a list of samples as one batch of right-padded tensors.

``collate(samples)`` right-pads into tensors: ``tokens``, ``attention_mask``, ``loss_mask``
(over the full sequence, prompt positions 0), ``rollout_log_probs`` (same layout, 0 on the
prompt), ``rewards`` (the scalar reward), ``response_lengths``, ``prompt_lengths``,
``remove_sample``, ``stale`` (bool [B]: a stale sample the ``keep`` staleness policy kept;
its ``loss_mask`` row is all zeros, whatever the sample holds, so it gives no gradient while
its reward counts in its group's statistics, as ``remove_sample`` is False for it) and
``token_versions`` (int64, same layout: the server-reported weight
version of each sampled token, -1 on the prompt, on padding, on observation tokens and
where no version is known). The teacher lanes add, when every sample that is not removed
carries them (masked dummies get zeros): ``teacher_log_probs`` [B, T] float32 (the mixed
lane's +1.0 sentinel at teacher positions), ``teacher_topk_ids`` [B, T, K] int64,
``teacher_topk_log_probs`` [B, T, K] float32, ``action_mask`` [B, T] (student action
tokens only) and ``is_teacher_mask`` [B, T], all in the layout of ``tokens`` (prompt 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.agents.result import UNKNOWN_VERSION
from engine.events.arrays import LogProbs, Mask, PackedArray, TokenIds
from engine.projections.samples import scalar_reward
from engine.sample import Sample

__all__ = ["collate"]


def collate(samples: Sequence[Sample], pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad samples into a batch of tensors (see the module docstring).

    Each field is built as one numpy array and handed to torch once: the samples' packed
    arrays are joined (bytes, no per-token Python objects) and scattered into the padded
    batch with one boolean-mask assignment in row-major order, which is exactly "row i,
    positions 0..n_i" for the tokens and "row i, its response positions" for the rest.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    batch = len(samples)
    lengths = np.fromiter((len(s.tokens) for s in samples), dtype=np.int64, count=batch)
    responses = np.fromiter((s.response_length for s in samples), dtype=np.int64, count=batch)
    width = int(lengths.max())
    position = np.arange(width, dtype=np.int64)
    valid = position < lengths[:, None]
    response = valid & (position >= (lengths - responses)[:, None])

    tokens = np.full((batch, width), pad_token_id, dtype=np.int64)
    tokens[valid] = _joined(TokenIds, [s.tokens for s in samples])
    loss_mask = np.zeros((batch, width), dtype=np.float32)
    loss_mask[response] = _joined(Mask, [s.loss_mask for s in samples])
    stale = np.fromiter((s.stale for s in samples), dtype=np.bool_, count=batch)
    loss_mask[stale] = 0.0
    logprobs = np.zeros((batch, width), dtype=np.float32)
    logprobs[response] = _joined(
        LogProbs, [_or_zeros(s.rollout_log_probs, s.response_length) for s in samples]
    )
    out = {
        "tokens": torch.from_numpy(tokens),
        "attention_mask": torch.from_numpy(valid.astype(np.int64)),
        "loss_mask": torch.from_numpy(loss_mask),
        "rollout_log_probs": torch.from_numpy(logprobs),
        "rewards": torch.from_numpy(
            np.array([scalar_reward(s.reward) for s in samples], dtype=np.float32)
        ),
        "response_lengths": torch.from_numpy(responses),
        "prompt_lengths": torch.from_numpy(lengths - responses),
        "remove_sample": torch.from_numpy(
            np.fromiter((s.remove_sample for s in samples), dtype=np.bool_, count=batch)
        ),
        "stale": torch.from_numpy(stale),
    }
    versions = np.full((batch, width), UNKNOWN_VERSION, dtype=np.int64)
    versions[response] = _joined(
        TokenIds, [_or_unknown(s.token_versions, s.response_length) for s in samples]
    )
    out["token_versions"] = torch.from_numpy(versions)
    per_token: tuple[tuple[str, type[PackedArray], Any], ...] = (
        ("teacher_log_probs", LogProbs, np.float32),
        ("action_mask", Mask, np.float32),
        ("is_teacher_mask", Mask, np.float32),
    )
    for name, kind, dtype in per_token:
        arrays = _lane_field(samples, name)
        if arrays is not None:
            values = np.zeros((batch, width), dtype=dtype)
            values[response] = _joined(
                kind, [a if a is not None else kind(bytes(kind.itemsize * s.response_length))
                       for a, s in zip(arrays, samples, strict=True)]
            )
            out[name] = torch.from_numpy(values)
    if _lane_field(samples, "teacher_topk_ids") is not None:
        out.update(_topk(samples, width))
    return out


def _lane_field(samples: Sequence[Sample], name: str) -> list[Any] | None:
    """A lane's per-token field of each sample, when every sample that is not removed has it
    (and one does); removed samples (masked dummies) then get zeros. None: not a batch field."""
    arrays = [getattr(s, name) for s in samples]
    kept = [a for a, s in zip(arrays, samples, strict=True) if not s.remove_sample]
    if not any(a is not None for a in arrays) or any(a is None for a in kept):
        return None
    return arrays


def _topk(samples: Sequence[Sample], width: int) -> dict[str, torch.Tensor]:
    """``teacher_topk_ids`` [B, T, K] int64 and ``teacher_topk_log_probs`` [B, T, K] float32,
    aligned with ``tokens`` (zeros on the prompt, padding and removed samples)."""
    ks = {s.teacher_top_k for s in samples if s.teacher_topk_ids is not None}
    if len(ks) != 1:
        raise ValueError(f"collate: the samples' teacher top-K differ: {sorted(ks)}")
    (k,) = ks
    batch = len(samples)
    ids = np.zeros((batch, width, k), dtype=np.int64)
    lps = np.zeros((batch, width, k), dtype=np.float32)
    # Row by row: each sample's rows are one contiguous block (a copy, no boolean scatter
    # over a [B, T, K] array).
    for row, s in enumerate(samples):
        if s.teacher_topk_ids is None or s.teacher_topk_log_probs is None:
            continue  # a removed sample: zeros
        end = len(s.tokens)
        start = end - s.response_length
        ids[row, start:end] = s.teacher_topk_ids.numpy().reshape(-1, k)
        lps[row, start:end] = s.teacher_topk_log_probs.numpy().reshape(-1, k)
    return {
        "teacher_topk_ids": torch.from_numpy(ids),
        "teacher_topk_log_probs": torch.from_numpy(lps),
    }


def _joined(kind: type[PackedArray], arrays: Sequence[PackedArray]) -> np.ndarray[Any, Any]:
    """The arrays' values end to end, as one read-only numpy array of ``kind``'s dtype."""
    return np.frombuffer(b"".join(a.data for a in arrays), dtype=kind.dtype)


def _or_zeros(array: LogProbs | None, n: int) -> PackedArray:
    return array if array is not None else LogProbs(bytes(LogProbs.dtype.itemsize * n))


_UNKNOWN_INT32 = np.array([UNKNOWN_VERSION], dtype=TokenIds.dtype).tobytes()


def _or_unknown(array: TokenIds | None, n: int) -> PackedArray:
    return array if array is not None else TokenIds(_UNKNOWN_INT32 * n)
