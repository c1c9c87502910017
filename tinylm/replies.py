"""The shapes of SGLang 0.5.23's ``/generate`` replies, built in one place for tinylm.

Both the finished reply (``scheduler.py``) and the chunks of a streamed one
(``generate_stream.py``) are made here, so the two cannot drift. Sources, under
``python/sglang/srt/``:

- ``meta_info`` (``managers/tokenizer_manager.py``, ``TokenizerManager._handle_batch_output``):
  ``id``, ``finish_reason`` (null while a streamed request runs), ``prompt_tokens``,
  ``weight_version``, ``num_retractions``, the logprob fields when ``return_logprob``,
  ``reasoning_tokens``, ``completion_tokens``, ``cached_tokens``; once finished also
  ``weight_versions`` and ``e2e_latency``. ``_stream_one_response`` adds
  ``response_sent_to_client_ts`` (wall-clock seconds) to the first reply a request sends.
- logprob fields (``add_logprob_to_meta_info``): ``input_token_logprobs``,
  ``output_token_logprobs`` (``[logprob, token_id, text_or_null]`` triples),
  ``output_token_logprobs_length``, and with ``top_logprobs_num > 0`` ``input_top_logprobs`` /
  ``output_top_logprobs`` (a ``null`` row where a position has none).
- ``weight_versions`` (``utils/weight_versions.py``, ``compute_weight_version_spans`` and
  ``add_weight_versions_to_meta_info``): ``[{"version", "start", "end"}]``, the output-token
  ranges each weight version produced; one span unless the weights changed under the request
  (a weight update while generation was paused in place). ``weight_version`` is then the last
  span's version.
- finish reasons (``managers/schedule_batch.py``): ``FINISH_ABORT().to_json()`` is
  ``{"type": "abort", "message": "Aborted", "status_code": null, "err_type": null}`` for a
  running request an ``/abort_request`` ends; a request aborted while still queued is answered
  by ``TokenizerManager._handle_abort_req`` with ``{"type": "abort", "message": "Abort in
  waiting queue"}`` and a shorter ``meta_info`` (no ``prompt_tokens``, ``cached_tokens``,
  ``num_retractions`` or ``reasoning_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "LogprobPairs",
    "TopRows",
    "abort_reason",
    "logprob_fields",
    "meta_info",
    "queued_abort_meta",
    "version_spans",
]

LogprobPairs = Sequence[tuple[float | None, int]]
TopRows = Sequence[Sequence[tuple[float, int]] | None]
TextOf = Callable[[int], str] | None  # token id -> text, for ``return_text_in_logprobs``

QUEUED_ABORT_MESSAGE = "Abort in waiting queue"


def abort_reason(message: str | None = None, status_code: int | None = None) -> dict[str, Any]:
    """``FINISH_ABORT(message, status_code).to_json()``."""
    return {
        "type": "abort",
        "message": message or "Aborted",
        "status_code": status_code,
        "err_type": None,
    }


def version_spans(
    changes: Sequence[tuple[str, int]], current: str, num_tokens: int
) -> list[dict[str, Any]]:
    """``meta_info["weight_versions"]``: ``changes`` are ``(old_version, tokens_then)`` in the
    order the weights changed under the request, ``current`` the version now."""
    spans: list[dict[str, Any]] = []
    for version, end in [*changes, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < num_tokens or s["start"] == 0]


def _triples(pairs: LogprobPairs, text_of: TextOf) -> list[list[Any]]:
    if text_of is None:
        return [[lp, tid, None] for lp, tid in pairs]
    return [[lp, tid, text_of(tid)] for lp, tid in pairs]


def logprob_fields(
    *,
    top_logprobs_num: int,
    input_logprobs: LogprobPairs,
    input_top: TopRows,
    output_logprobs: LogprobPairs,
    output_top: TopRows,
    text_of: TextOf,
) -> dict[str, Any]:
    """The logprob keys of ``meta_info`` for a ``return_logprob`` request."""
    fields: dict[str, Any] = {
        "input_token_logprobs": _triples(input_logprobs, text_of),
        "output_token_logprobs": _triples(output_logprobs, text_of),
        "output_token_logprobs_length": len(output_logprobs),
    }
    if top_logprobs_num > 0:
        fields["input_top_logprobs"] = [
            None if row is None else _triples(row, text_of) for row in input_top
        ]
        fields["output_top_logprobs"] = [
            None if row is None else _triples(row, text_of) for row in output_top
        ]
    return fields


def meta_info(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_tokens: int,
    completion_tokens: int,
    weight_version: str,
    logprobs: dict[str, Any] | None,
    spans: list[dict[str, Any]] | None = None,
    e2e_latency: float | None = None,
) -> dict[str, Any]:
    """A request's ``meta_info``, running (``finish_reason`` None) or finished (with the
    ``spans`` and ``e2e_latency``), keys in SGLang's order."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "weight_version": weight_version,
        "num_retractions": 0,
        **(logprobs or {}),
        "reasoning_tokens": 0,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }
    if spans is not None:
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
    if e2e_latency is not None:
        meta["e2e_latency"] = e2e_latency
    return meta


def queued_abort_meta(
    *,
    rid: str,
    weight_version: str,
    e2e_latency: float,
    logprobs: dict[str, Any] | None,
    message: str = QUEUED_ABORT_MESSAGE,
) -> dict[str, Any]:
    """``_handle_abort_req``'s ``meta_info`` for a request that never left the waiting queue."""
    spans = version_spans((), weight_version, 0)
    return {
        "id": rid,
        "finish_reason": {"type": "abort", "message": message},
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
        "weight_versions": spans,
        **(logprobs or {}),
        "completion_tokens": 0,
    }
