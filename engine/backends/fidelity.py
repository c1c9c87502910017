"""Token fidelity: do the logprobs recorded at sampling match a re-score of the same tokens?

RL trains on ``log p(token)`` as recorded while sampling. If the server's sampling path and its
prefill (scoring) path disagree, through a different kernel, a temperature folded into the
reported logprobs (SGLang's default unless ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), or tokens
that were re-tokenised on the way, the importance ratios are wrong from the first step.

``check_token_fidelity`` force-decodes ``prompt + response`` on the same server (one prefill
with ``return_logprob``: the ``score`` of a backend with the scoring capability), takes the
logprob of each response token given everything before it, and compares it with the
recorded value. On tinylm (fp32, raw
logprobs) the difference is float rounding, far below the default tolerance of ``1e-5``.
``compare_logprobs`` is the pure comparison, for callers that already have both series.

Two uses on the rollout path (``engine.actors.verify``):

- ``check_sampled_tokens`` re-scores one finished multi-turn sample: one prefill of
  ``prompt + response`` and the sampled positions compared, but only those the server's current
  weight version sampled (a position of another version is counted, never compared: a weight
  update between generation and re-score must not read as a mismatch).
- ``check_server_logprobs`` runs once when a worker starts: a short seeded generation at
  temperature 2 is re-scored. A server reporting temperature-scaled logprobs (SGLang without
  ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``) is off by far more than rounding there, and is refused
  with ``TemperatureScaledLogprobs`` naming the flag.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from engine.backends.base import GenerationResult, ModelBackend
from engine.errors import ConfigError

__all__ = [
    "DEFAULT_TOLERANCE",
    "ORIGINAL_LOGPROB_FLAG",
    "FidelityReport",
    "SampledCheck",
    "TemperatureScaledLogprobs",
    "check_generation",
    "check_sampled_tokens",
    "check_server_logprobs",
    "check_token_fidelity",
    "compare_logprobs",
]

ORIGINAL_LOGPROB_FLAG = "SGLANG_RETURN_ORIGINAL_LOGPROB=1"

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
    backend: ModelBackend,
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
    backend: ModelBackend,
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


@dataclass(frozen=True, slots=True)
class SampledCheck:
    """One sample's sampled tokens re-scored at the server's current weight version.

    ``n_tokens`` positions were compared; ``n_other_version`` sampled positions were not (their
    version is not the one the server scored with). ``position`` is the response index of the
    largest ``|delta logprob|`` (None when nothing was compared)."""

    n_tokens: int
    n_other_version: int
    max_abs_delta: float
    position: int | None
    weight_version: int | None


async def check_sampled_tokens(
    backend: ModelBackend,
    *,
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    logprobs: Sequence[float],
    sampled: Sequence[bool],
    versions: Sequence[int | None],
) -> SampledCheck:
    """Re-score ``response_ids`` after ``prompt_ids`` and compare, at each ``sampled`` position
    whose ``versions`` entry equals the version the server reports for the re-score (None ==
    None: a server that names no versions is taken to keep its weights), the recorded logprob
    with the re-scored one."""
    n = len(response_ids)
    if not len(logprobs) == len(sampled) == len(versions) == n:
        raise ValueError(
            f"{n} response tokens but {len(logprobs)} logprobs, {len(sampled)} mask entries "
            f"and {len(versions)} versions"
        )
    score = await backend.score(prompt_ids, response_ids)
    current = score.weight_version
    worst: int | None = None
    worst_delta = 0.0
    compared = other = 0
    for i in range(n):
        if not sampled[i]:
            continue
        if versions[i] != current:
            other += 1
            continue
        compared += 1
        a, b = logprobs[i], score.logprobs[i]
        delta = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
        if worst is None or delta > worst_delta:
            worst, worst_delta = i, delta
    return SampledCheck(compared, other, worst_delta, worst, current)


class TemperatureScaledLogprobs(ConfigError):
    """The model server reports logprobs of the temperature-scaled distribution."""


_PROBE_PROMPT = tuple(range(10, 26))


async def check_server_logprobs(
    backend: ModelBackend, *, tolerance: float = DEFAULT_TOLERANCE, tokens: int = 16
) -> FidelityReport:
    """Generate ``tokens`` seeded tokens at temperature 2 and re-score them; raise
    ``TemperatureScaledLogprobs`` (naming ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``) when they
    disagree by more than ``tolerance``. Returns the report when they agree."""
    result = await backend.generate(
        input_ids=_PROBE_PROMPT,
        sampling_params={
            "max_new_tokens": tokens,
            "temperature": 2.0,
            "ignore_eos": True,
            "sampling_seed": 0,
        },
    )
    report = await check_generation(backend, _PROBE_PROMPT, result, tolerance=tolerance)
    if not report.ok:
        raise TemperatureScaledLogprobs(
            f"the model server at {backend.base_url} reports logprobs that a re-score of the "
            f"same tokens does not reproduce ({report.describe()}, sampled at temperature 2): "
            f"it returns temperature-scaled logprobs, which skew every importance ratio. "
            f"Launch SGLang with {ORIGINAL_LOGPROB_FLAG} in its environment."
        )
    return report
