"""Token fidelity: do the logprobs recorded at sampling match a re-score of the same tokens?

RL trains on ``log p(token)`` as recorded while sampling. If the server's sampling path and its
prefill (scoring) path disagree, through a different kernel, a temperature folded into the
reported logprobs (SGLang's default unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), or tokens
that were re-tokenised on the way, the importance ratios are wrong from the first step.

``check_token_fidelity`` force-decodes ``prompt + response`` on the same server (one prefill
with ``return_logprob``, via ``SGLangBackend.score``), takes the logprob of each response token
given everything before it, and compares it with the recorded value. On tinylm (fp32, raw
logprobs) the difference is float rounding, far below the default tolerance of ``1e-5``.
``compare_logprobs`` is the pure comparison, for callers that already have both series.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.backends.base import GenerationResult
from engine.backends.sglang import SGLangBackend

__all__ = [
    "DEFAULT_TOLERANCE",
    "FidelityReport",
    "check_generation",
    "check_token_fidelity",
    "compare_logprobs",
]

DEFAULT_TOLERANCE = 1e-5


@dataclass(frozen=True, slots=True)
class FidelityReport:
    """Per-token ``|sampled - rescored|`` and whether all of them are within ``tolerance``."""

    n_tokens: int
    per_token_diffs: tuple[float, ...]
    max_abs_diff: float
    mean_abs_diff: float
    worst_index: int | None
    tolerance: float
    ok: bool

    def describe(self) -> str:
        if self.worst_index is None:
            return "token fidelity: nothing to compare"
        verdict = "ok" if self.ok else "MISMATCH"
        return (
            f"token fidelity {verdict}: {self.n_tokens} tokens, max |diff| "
            f"{self.max_abs_diff:.3g} at token {self.worst_index}, mean {self.mean_abs_diff:.3g}, "
            f"tolerance {self.tolerance:g}"
        )


def compare_logprobs(
    sampled: Sequence[float], rescored: Sequence[float], *, tolerance: float = DEFAULT_TOLERANCE
) -> FidelityReport:
    """Compare two logprob series of the same tokens (``ValueError`` if lengths differ)."""
    if len(sampled) != len(rescored):
        raise ValueError(f"{len(sampled)} sampled logprobs but {len(rescored)} rescored ones")
    diffs = tuple(
        abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
        for a, b in zip(sampled, rescored, strict=True)
    )
    if not diffs:
        return FidelityReport(0, (), 0.0, 0.0, None, tolerance, True)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return FidelityReport(
        n_tokens=len(diffs),
        per_token_diffs=diffs,
        max_abs_diff=diffs[worst],
        mean_abs_diff=sum(diffs) / len(diffs),
        worst_index=worst,
        tolerance=tolerance,
        ok=diffs[worst] <= tolerance,
    )


async def check_token_fidelity(
    backend: SGLangBackend,
    *,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    sampled_logprobs: Sequence[float],
    tolerance: float = DEFAULT_TOLERANCE,
) -> FidelityReport:
    """Re-score ``response_ids`` after ``prompt_ids`` and compare with ``sampled_logprobs``."""
    if len(response_ids) != len(sampled_logprobs):
        raise ValueError(
            f"{len(response_ids)} response tokens but {len(sampled_logprobs)} sampled logprobs"
        )
    score = await backend.score(prompt_ids, response_ids)
    return compare_logprobs(sampled_logprobs, score.logprobs, tolerance=tolerance)


async def check_generation(
    backend: SGLangBackend,
    prompt_ids: Sequence[int],
    result: GenerationResult,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> FidelityReport:
    """``check_token_fidelity`` for a ``GenerationResult`` the backend returned."""
    if result.token_ids is None or result.logprobs is None:
        raise ValueError("check_generation needs a token-level result (token_ids and logprobs)")
    return await check_token_fidelity(
        backend,
        prompt_ids=prompt_ids,
        response_ids=result.token_ids,
        sampled_logprobs=result.logprobs,
        tolerance=tolerance,
    )
