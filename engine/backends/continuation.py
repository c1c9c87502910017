"""A turn continued across a weight sync: what the rest of it asks for, and its parts as one.

When a weight sync interrupts a turn (``TurnGate.interrupt``), the server answers the aborted
request with the tokens it had sampled (SGLang's partial ``output_ids`` and their
``output_token_logprobs``, ``finish_reason`` ``abort``). The worker's bound view of the pool
(``engine/backends/pool.py``) then asks for the rest of the turn on the new weights: the
prompt plus those tokens, with ``rest_of_turn``'s token budget; ``joined`` makes the parts one
``GenerationResult`` as if one call had produced it, except that each token keeps the
logprob it was sampled with and the version that sampled it (``token_versions``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.backends.base import FinishReason, GenerationResult, Usage

__all__ = ["joined", "rest_of_turn"]

_SGLANG_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens when a request sets none


def rest_of_turn(params: Mapping[str, Any], done: int) -> dict[str, Any] | None:
    """``params`` for the rest of a turn that has ``done`` tokens (None: none are left)."""
    budget = params.get("max_new_tokens") or _SGLANG_MAX_NEW_TOKENS
    if budget - done <= 0:
        return None
    rest: dict[str, Any] = {**params, "max_new_tokens": budget - done}
    if params.get("min_new_tokens"):
        rest["min_new_tokens"] = max(0, int(params["min_new_tokens"]) - done)
    return rest


def joined(parts: Sequence[GenerationResult], finish: str | None = None) -> GenerationResult:
    """The parts of one turn as one result: tokens, logprobs and per-token versions in
    order, the last part's finish reason (or ``finish``) and version."""
    if len(parts) == 1 and finish is None:
        return parts[0]
    ids = tuple(tok for p in parts for tok in p.token_ids or ())
    versions = tuple(v for p in parts for v in p.versions())
    last = parts[-1] if parts else None
    first_usage = parts[0].usage if parts else None
    return GenerationResult(
        text="".join(p.text for p in parts),
        token_ids=ids,
        logprobs=tuple(lp for p in parts for lp in p.logprobs or ()),
        finish_reason=finish or (last.finish_reason if last else FinishReason.STOP),
        usage=None if first_usage is None else Usage(first_usage.prompt_tokens, len(ids)),
        weight_version=last.weight_version if last else None,
        token_versions=versions if len(set(versions)) > 1 else None,
    )
