"""The body of SGLang's ``POST /generate`` read into tinylm ``GenerateRequest``s.

As in SGLang 0.5.23 (``managers/io_struct.py``, ``GenerateReqInput``): ``input_ids`` or
``text`` (a list of either is a batch and returns a list), ``sampling_params`` (see
``sampling.py``; a list gives one per item), ``rid``, ``return_logprob``,
``logprob_start_len`` (default -1: the output tokens only), ``top_logprobs_num``,
``return_text_in_logprobs``. A batch given one string ``rid`` names its requests ``{rid}_{i}``
(``_normalize_rid``), and ``sampling_params.n > 1`` turns even a single prompt into a batch
(``_handle_parallel_sampling``) of ``batch * n`` requests, the ``n`` samples of each prompt
together (``TokenizerManager._handle_batch_request``); SGLang gives each parallel sample a
fresh uuid, tinylm names them ``{rid}_{j}``.

A field of the wrong type is a ``SchemaError`` (SGLang's request model refuses it before the
request starts); any other refusal a ``BadRequest``, whose message names the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tinylm.sampling import SamplingParams
from tinylm.scheduler import GenerateRequest

__all__ = ["BadRequest", "GenerateInput", "SchemaError"]


class BadRequest(ValueError):
    """A client error; the message is sent back with the status."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class SchemaError(BadRequest):
    """A ``/generate`` field of the wrong type: refused by SGLang's request model before the
    request starts, so a 400 even for a stream (other refusals of a stream are events)."""


def _field(body: dict[str, Any], key: str, index: int, batch: int | None, default: Any) -> Any:
    """``body[key]`` for item ``index``: per-item when a batch gave a list, else shared."""
    value = body.get(key, default)
    if batch is not None and isinstance(value, list):
        if len(value) != batch:
            raise BadRequest(f"{key} has {len(value)} entries for a batch of {batch}")
        return value[index]
    return value


class GenerateInput:
    """Reads ``/generate`` bodies: ``encode`` tokenizes a ``text``, ``new_rid`` names a
    request sent without a ``rid``."""

    def __init__(self, encode: Callable[[str], list[int]], new_rid: Callable[[], str]) -> None:
        self._encode = encode
        self._new_rid = new_rid

    def parse(self, body: dict[str, Any]) -> tuple[list[GenerateRequest], bool]:
        """The requests of a ``/generate`` body, and whether it is a batch (a list of prompts,
        or ``n > 1``: the reply is a list)."""
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise BadRequest("give exactly one of 'input_ids' and 'text'")
        prompts: list[list[int]]
        if has_ids:
            ids = body["input_ids"]
            batch = isinstance(ids, list) and bool(ids) and all(isinstance(x, list) for x in ids)
            prompts = ids if batch else [ids]
            for i, p in enumerate(prompts):
                if not isinstance(p, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in p
                ):
                    raise SchemaError(
                        f"input_ids{f'[{i}]' if batch else ''} must be a list of ints"
                    )
        else:
            text = body["text"]
            batch = isinstance(text, list)
            texts = text if batch else [text]
            if not all(isinstance(t, str) for t in texts):
                raise SchemaError("text must be a string or a list of strings")
            prompts = [self._encode(t) for t in texts]
        n = _parallel_samples(body.get("sampling_params"))
        size = len(prompts) if batch else None
        requests = [self._request(body, i, size, p) for i, p in enumerate(prompts)]
        if n > 1:
            requests = self._expand(requests, n, body.get("rid"))
        return requests, batch or n > 1

    def _expand(self, requests: list[GenerateRequest], n: int, rid: Any) -> list[GenerateRequest]:
        """``n`` samples of each request, prompt-major, named ``{rid}_{j}`` (module docstring)."""
        out: list[GenerateRequest] = []
        for req in requests:
            for _ in range(n):
                j = len(out)
                if isinstance(rid, list):
                    name = f"{req.rid}_{j % n}"
                elif isinstance(rid, str):
                    name = f"{rid}_{j}"
                else:
                    name = self._new_rid()
                out.append(dataclasses.replace(req, rid=name))
        return out

    def _request(
        self, body: dict[str, Any], i: int, batch: int | None, ids: list[int]
    ) -> GenerateRequest:
        where = (
            f"sampling_params[{i}]"
            if batch is not None and isinstance(body.get("sampling_params"), list)
            else "sampling_params"
        )
        raw_sampling = _field(body, "sampling_params", i, batch, None)
        if isinstance(raw_sampling, dict) and "n" in raw_sampling:
            raw_sampling = {k: v for k, v in raw_sampling.items() if k != "n"}  # see _expand
        try:
            sampling = SamplingParams.from_json(raw_sampling, where=where)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        rid = _field(body, "rid", i, batch, None)
        if rid is None:
            rid = self._new_rid()
        elif not isinstance(rid, str) or not rid:
            raise SchemaError(f"rid must be a non-empty string, got {rid!r}")
        elif batch is not None and not isinstance(body.get("rid"), list):
            rid = f"{rid}_{i}"  # SGLang's GenerateReqInput._normalize_rid
        return_logprob = _field(body, "return_logprob", i, batch, False)
        start = _field(body, "logprob_start_len", i, batch, -1)
        top_k = _field(body, "top_logprobs_num", i, batch, 0)
        text_in = body.get("return_text_in_logprobs", False)
        for key, value, kind in (
            ("return_logprob", return_logprob, bool),
            ("return_text_in_logprobs", text_in, bool),
            ("logprob_start_len", start, int),
            ("top_logprobs_num", top_k, int),
        ):
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise SchemaError(f"{key} must be {kind.__name__}, got {value!r}")
        if start < -1 or top_k < 0:
            raise BadRequest(
                f"logprob_start_len must be >= -1 and top_logprobs_num >= 0, "
                f"got {start} and {top_k}"
            )
        if start == -1:
            # SGLang's default: logprobs for the output tokens (and the last prompt token).
            start = len(ids) - 1
        return GenerateRequest(
            rid=rid,
            input_ids=tuple(ids),
            sampling=sampling,
            return_logprob=return_logprob,
            logprob_start_len=start,
            top_logprobs_num=top_k,
            return_text_in_logprobs=text_in,
        )


def _parallel_samples(raw: Any) -> int:
    """``sampling_params.n`` (the same in every item of a list, as SGLang requires)."""
    items = raw if isinstance(raw, list) else [raw]
    values = {item.get("n", 1) if isinstance(item, dict) else 1 for item in items}
    if len(values) > 1:
        raise BadRequest(
            "sampling_params.n must be the same for every item of a batch, got "
            f"{sorted(map(repr, values))}"
        )
    n = values.pop() if values else 1
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise BadRequest(f"sampling_params.n must be an integer >= 1, got {n!r}")
    return n
