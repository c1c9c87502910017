"""Sampling parameters and next-token sampling for the tinylm server.

``SamplingParams.from_json`` accepts SGLang's ``sampling_params`` object (the fields below; an
unknown key, or a known one this server cannot honour such as ``n > 1``, is refused with a
message naming it, as SGLang refuses unknown keys).

``next_token`` picks one token from a logits row:

- greedy when ``temperature == 0`` or ``top_k == 1`` (argmax, lowest id on ties);
- otherwise temperature, then top-k, top-p (keep the smallest prefix of the sorted
  distribution whose mass before each kept token is <= ``top_p``, SGLang's rule) and min-p,
  then one inverse-CDF draw from the request's own ``torch.Generator`` (over the unsorted
  distribution when nothing is filtered). A request seeded with ``sampling_seed`` therefore
  draws the same tokens whatever else is in the batch.

Reported logprobs (``LogprobMode``), as SGLang 0.5.23 computes them (``srt/layers/sampler.py``,
``Sampler.forward``):

- ``processed`` (SGLang's default): the log-softmax of the temperature-scaled logits,
  ``log_softmax(logits / temperature)``, the distribution before top-k / top-p / min-p
  filtering (SGLang's renormalising filters build new tensors; ``logprobs = log(probs)`` reads
  the unfiltered one). Greedy requests report the raw logprobs. A prefill re-score of the same
  tokens reports raw logprobs (``logprob_processor.py``), so at a temperature other than 1 the
  two disagree: an importance ratio built from them is skewed.
- ``original``: ``log_softmax`` of the raw logits, before temperature or filtering; what a
  force-decode computes, so sampling-time and scoring-time logprobs agree to float rounding.
  SGLang returns this only with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set true (``1`` / ``true``,
  read once at start; unset or anything else is false), which RL deployments set for exactly
  that reason. tinylm reads the same variable (``logprob_mode_from_env``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "RETURN_ORIGINAL_LOGPROB_ENV",
    "LogprobMode",
    "SamplingParams",
    "logprob_mode_from_env",
    "next_token",
]

RETURN_ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


class LogprobMode(StrEnum):
    ORIGINAL = "original"
    PROCESSED = "processed"


def logprob_mode_from_env(environ: Mapping[str, str] | None = None) -> LogprobMode:
    """``original`` when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is ``1`` or ``true`` (any case),
    else ``processed``: SGLang 0.5.23's ``get_bool_env_var`` (``srt/utils/common.py``,
    default ``"false"``; an unrecognised value is false, with a warning there and here)."""
    env = os.environ if environ is None else environ
    value = env.get(RETURN_ORIGINAL_LOGPROB_ENV, "false").lower()
    if value not in ("true", "1", "false", "0"):
        log.warning(
            "%s=%r is neither true/1 nor false/0: treated as false (temperature-scaled "
            "logprobs), as SGLang does",
            RETURN_ORIGINAL_LOGPROB_ENV,
            value,
        )
    return LogprobMode.ORIGINAL if value in ("true", "1") else LogprobMode.PROCESSED


# Keys SGLang accepts that this server honours only at their neutral value.
_NEUTRAL = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "logit_bias": None,
    "custom_params": None,
}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's sampling settings (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    stream_interval: int | None = None  # a stream's chunk size in tokens (None: the server's)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_json(cls, raw: Any, *, where: str = "sampling_params") -> SamplingParams:
        """Validate SGLang's ``sampling_params`` object; ``ValueError`` names the bad key."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} must be an object, got {type(raw).__name__}")
        values: dict[str, Any] = {}
        for key, value in raw.items():
            name = f"{where}.{key}"
            if key in _NEUTRAL:
                if value is not None and value != _NEUTRAL[key]:
                    raise ValueError(f"{name}={value!r} is not supported by tinylm")
                continue
            if key in ("max_new_tokens", "top_k"):
                values[key] = _int(value, name)
            elif key in ("temperature", "top_p", "min_p"):
                values[key] = _float(value, name)
            elif key in (
                "ignore_eos",
                "skip_special_tokens",
                "no_stop_trim",
                "spaces_between_special_tokens",
            ):
                if not isinstance(value, bool):
                    raise ValueError(f"{name} must be a boolean, got {value!r}")
                values[key] = value
            elif key == "stop":
                values[key] = _stops(value, name)
            elif key == "stop_token_ids":
                if value is None:
                    continue
                if not isinstance(value, list):
                    raise ValueError(f"{name} must be a list of token ids, got {value!r}")
                values[key] = tuple(_int(v, name) for v in value)
            elif key in ("sampling_seed", "stream_interval"):
                values[key] = None if value is None else _int(value, name)
            else:
                raise ValueError(f"unknown sampling parameter {name!r}")
        params = cls(**values)
        params.check(where)
        return params

    def check(self, where: str = "sampling_params") -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"{where}.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"{where}.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{where}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{where}.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{where}.min_p must be in [0, 1], got {self.min_p}")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"{where}.stream_interval must be >= 1, got {self.stream_interval}")


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _stops(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r}")
    return tuple(items)


def next_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    *,
    mode: LogprobMode = LogprobMode.ORIGINAL,
) -> tuple[int, torch.Tensor]:
    """Pick the next token from a 1-d fp32 logits row; also return the reported logprobs row."""
    raw = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        return int(torch.argmax(logits)), raw
    probs = torch.softmax(logits / params.temperature, dim=-1)
    target = torch.rand((), generator=generator, dtype=torch.float64)
    if params.top_k <= 0 and params.top_p >= 1.0 and params.min_p <= 0.0:
        # Nothing to filter: draw from the whole distribution without sorting it.
        cdf = probs.double().cumsum(0)
        index = min(
            int(torch.searchsorted(cdf, (target * cdf[-1]).reshape(1), right=True)),
            probs.shape[0] - 1,
        )
        if mode == LogprobMode.ORIGINAL:
            return index, raw
        return index, torch.log_softmax(logits / params.temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True, stable=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if params.top_k > 0:
        keep[params.top_k :] = False
    if params.top_p < 1.0:
        keep &= (sorted_probs.cumsum(0) - sorted_probs) <= params.top_p
    if params.min_p > 0.0:
        keep &= sorted_probs >= sorted_probs[0] * params.min_p
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).double()
    cdf = kept.cumsum(0)
    last_kept = int(keep.nonzero().max())
    index = min(int(torch.searchsorted(cdf, (target * cdf[-1]).reshape(1), right=True)), last_kept)
    token = int(order[index])
    if mode == LogprobMode.ORIGINAL:
        return token, raw
    return token, torch.log_softmax(logits / params.temperature, dim=-1)
