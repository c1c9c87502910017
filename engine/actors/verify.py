"""The verification boundary on the rollout path: re-score a fraction of completed samples.

RL trains on the logprobs recorded while sampling; if the server's sampling and scoring
paths disagree (a temperature folded in, a differing kernel, re-tokenised tokens), every
importance ratio is wrong and nothing else notices. So:

* ``selected`` picks samples by a hash of their id (``verify_fraction`` knob, else
  ``ROLLOUT_VERIFY_FRACTION``, default 0): the same ones on every run and on replay.
* ``verify_result`` (worker side, on the trajectory's server) re-scores ``prompt +
  response`` in one prefill and compares each sampled token of the server's current weight
  version (tokens of another only counted). A sample with none left, or whose re-score
  cannot run, is skipped with the reason, never failed. Its ``SampleVerified`` precedes the
  ``SampleCompleted``, so a finalizer has folded it before the sample is terminal.
* ``VerifyTally`` (finalizer side) fails the rollout on a check past its threshold
  (``verify_threshold`` knob, ``ROLLOUT_VERIFY_THRESHOLD``, default ``DEFAULT_THRESHOLD``,
  chosen as docs/sglang.md says), else adds ``verify/*`` to ``RolloutReady.metrics``.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.agents.result import UNKNOWN_VERSION, AgentResult
from engine.backends.base import ModelBackend
from engine.backends.fidelity import (
    TemperatureScaledLogprobs,
    check_sampled_tokens,
    check_server_logprobs,
)
from engine.backends.pool import BackendPool
from engine.errors import ConfigError
from engine.events.catalog import RolloutFailed, SampleVerified

__all__ = [
    "DEFAULT_THRESHOLD",
    "FRACTION_KNOB",
    "THRESHOLD_KNOB",
    "VerifyPolicy",
    "VerifyTally",
    "check_servers",
    "selected",
    "verify_result",
]

logger = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 1e-3
FRACTION_KNOB = "verify_fraction"
THRESHOLD_KNOB = "verify_threshold"


@dataclass(frozen=True, kw_only=True)
class VerifyPolicy:
    """Which share of completed samples to re-score, and the largest ``|delta logprob|``
    a re-score may show."""

    fraction: float = 0.0
    threshold: float = DEFAULT_THRESHOLD

    def __post_init__(self) -> None:
        _check_fraction(self.fraction, "verify fraction")
        _check_threshold(self.threshold, "verify threshold")

    def for_request(self, knobs: Mapping[str, Any]) -> VerifyPolicy:
        """This policy with the request's ``verify_fraction`` / ``verify_threshold`` knobs."""
        fraction, threshold = self.fraction, self.threshold
        if knobs.get(FRACTION_KNOB) is not None:
            fraction = _check_fraction(knobs[FRACTION_KNOB], f"knob {FRACTION_KNOB}")
        if knobs.get(THRESHOLD_KNOB) is not None:
            threshold = _check_threshold(knobs[THRESHOLD_KNOB], f"knob {THRESHOLD_KNOB}")
        return VerifyPolicy(fraction=fraction, threshold=threshold)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    return float(value)


def _check_fraction(value: Any, what: str) -> float:
    number = _number(value, what)
    if not 0.0 <= number <= 1.0:
        raise ConfigError(f"{what} must be in [0, 1], got {value!r}")
    return number


def _check_threshold(value: Any, what: str) -> float:
    number = _number(value, what)
    if number < 0.0:
        raise ConfigError(f"{what} must be >= 0, got {value!r}")
    return number


def selected(sample_id: str, fraction: float) -> bool:
    """Whether ``sample_id`` is re-scored: its BLAKE2b hash as a number in [0, 1) is below
    ``fraction`` (deterministic; about ``fraction`` of any set of ids)."""
    if fraction <= 0.0:
        return False
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


async def verify_result(
    backends: BackendPool | None,
    *,
    rollout_id: str,
    sample_id: str,
    attempt: int,
    result: AgentResult,
    threshold: float,
) -> SampleVerified:
    """Re-score ``result``'s sampled tokens on the trajectory's server, ``backends.get()``."""

    def verdict(**fields: Any) -> SampleVerified:
        return SampleVerified(
            rollout_id=rollout_id,
            sample_id=sample_id,
            attempt=attempt,
            threshold=threshold,
            **fields,
        )

    mask = result.loss_mask.numpy().astype(bool)
    if result.teacher_mask is not None:
        mask &= ~result.teacher_mask.numpy().astype(bool)  # a teacher's tokens: not ours
    if not mask.any():
        return verdict(skipped="no sampled tokens")
    try:
        backend = backends.get() if backends is not None else None
    except Exception as exc:  # no endpoint configured, the pool closing
        backend, kind = None, f"{type(exc).__name__}: {exc}"
    else:
        kind = repr(backend) if backend is not None else "no backend"
    if backend is None or not backend.capabilities.scoring:
        return verdict(skipped=f"no token-level backend to re-score on ({kind})"[:500])
    if not len(result.prompt_token_ids):
        return verdict(skipped="no prompt tokens")
    n = len(result.response_token_ids)
    raw = result.response_versions.numpy().tolist() if len(result.response_versions) else []
    versions = [None if v == UNKNOWN_VERSION else int(v) for v in raw] or [None] * n
    try:
        check = await check_sampled_tokens(
            backend,
            prompt_ids=result.prompt_token_ids.numpy().tolist(),
            response_ids=result.response_token_ids.numpy().tolist(),
            logprobs=result.response_logprobs.numpy().tolist(),
            sampled=mask.tolist(),
            versions=versions,
        )
    except Exception as exc:  # the sample stands; the check is recorded as not run
        logger.warning("verify: re-scoring %s failed: %r", sample_id, exc)
        return verdict(skipped=f"re-score failed: {type(exc).__name__}: {exc}"[:500])
    if not check.n_tokens:
        return verdict(
            n_other_version=check.n_other_version,
            weight_version=check.weight_version,
            skipped="weight version changed since sampling",
        )
    return verdict(
        n_tokens=check.n_tokens,
        n_other_version=check.n_other_version,
        max_abs_delta=check.max_abs_delta,
        position=check.position,
        weight_version=check.weight_version,
        exceeded=not check.max_abs_delta <= threshold,
    )


@dataclass
class VerifyTally:
    """The finalizer's fold of a rollout's ``SampleVerified`` events: each sample's latest
    attempt; a repeated event changes nothing."""

    by_sample: dict[str, SampleVerified] = field(default_factory=dict)

    def add(self, event: SampleVerified) -> None:
        previous = self.by_sample.get(event.sample_id)
        if previous is None or event.attempt >= previous.attempt:
            self.by_sample[event.sample_id] = event

    @property
    def failure(self) -> SampleVerified | None:
        """The worst check past its threshold, if any."""
        past = [e for e in self.by_sample.values() if e.exceeded]
        return max(past, key=lambda e: (e.max_abs_delta, e.sample_id)) if past else None

    def failed(self, rollout_id: str) -> RolloutFailed | None:
        worst = self.failure
        if worst is None:
            return None
        return RolloutFailed(
            rollout_id=rollout_id,
            reason=(
                f"verification boundary: sample {worst.sample_id} (attempt {worst.attempt}) "
                f"re-scored on its server at weight version {worst.weight_version} differs "
                f"from its recorded logprobs by max |delta logprob| = {worst.max_abs_delta:.6g} "
                f"at response token position {worst.position}, over the threshold "
                f"{worst.threshold:g} ({worst.n_tokens} tokens compared)"
            ),
        )

    def metrics(self) -> dict[str, float]:
        """``verify/*`` figures for ``RolloutReady.metrics``; empty when none was selected."""
        if not self.by_sample:
            return {}
        events = self.by_sample.values()
        checked = [e for e in events if not e.skipped]
        return {
            "verify/selected": float(len(self.by_sample)),
            "verify/checked": float(len(checked)),
            "verify/skipped": float(len(self.by_sample) - len(checked)),
            "verify/tokens": float(sum(e.n_tokens for e in checked)),
            "verify/tokens_other_version": float(sum(e.n_other_version for e in events)),
            "verify/max_abs_delta": max((e.max_abs_delta for e in checked), default=0.0),
        }


async def check_servers(backends: BackendPool | None, *, threshold: float) -> None:
    """A worker's start-up check: each default server with the token_ids and scoring
    capabilities must report logprobs a re-score reproduces, else
    ``TemperatureScaledLogprobs`` (a ``ConfigError``). An unreachable server is logged,
    not refused: it may come up later. A mismatch across which the server's weight version
    changed (a sync loaded new weights between the generation and its re-score) says
    nothing about its logprobs: the check runs again."""
    if backends is None:
        return
    for url in backends.default_urls:
        try:
            backend = backends.get(url)
        except Exception as exc:
            logger.warning("verify: no backend for %s to check at start: %r", url, exc)
            continue
        if not (backend.capabilities.token_ids and backend.capabilities.scoring):
            continue
        for check in range(1, _START_CHECKS + 1):
            before = await _version(backend)
            try:
                report = await check_server_logprobs(backend, tolerance=max(threshold, 1e-4))
            except TemperatureScaledLogprobs:
                if check < _START_CHECKS and await _version(backend) != before:
                    logger.info("verify: %s loaded new weights during its check; again", url)
                    continue
                raise
            except Exception as exc:
                logger.warning("verify: could not check the logprobs of %s at start: %r",
                               url, exc)
                break
            logger.info("verify: %s: %s", url, report.describe())
            break


_START_CHECKS = 3


async def _version(backend: ModelBackend) -> int | str | None:
    """The server's weight version, or a marker that it could not be read."""
    if not backend.capabilities.weight_version:
        return None
    try:
        return await backend.weight_version()
    except Exception as exc:
        return f"unread: {exc!r}"
