"""SGLang's native ``/generate`` reply, read strictly.

The shape (sgl-project/sglang, ``python/sglang/srt/managers/tokenizer_manager.py``:
``convert_logprob_style`` / ``detokenize_logprob_tokens``; finish reasons from
``python/sglang/srt/managers/schedule_batch.py``, ``FINISH_*.to_json``)::

    {"text": "...", "output_ids": [...],            # output_ids only in newer releases
     "meta_info": {
        "id": "<rid>", "prompt_tokens": P, "completion_tokens": C, "cached_tokens": 0,
        "finish_reason": {"type": "stop", "matched": <token id or stop string>}
                       | {"type": "length", "length": C}
                       | {"type": "abort", "message": "..."},
        # with return_logprob:
        "input_token_logprobs":  [[logprob | null, token_id, text | null], ...],
        "output_token_logprobs": [[logprob, token_id, text | null], ...],
        # with top_logprobs_num > 0, one entry per position (null where nothing was computed):
        "input_top_logprobs":  [null | [[logprob, token_id, text | null], ...], ...],
        "output_top_logprobs": [[[logprob, token_id, text | null], ...], ...]}}

``input_token_logprobs`` covers prompt positions ``logprob_start_len .. P - 1`` (so
``P == logprob_start_len + len(input_token_logprobs)``), and its first entry (the token at
``logprob_start_len``) has a null logprob: SGLang 0.5.23 writes ``[None] +
input_token_logprobs[:-1]`` (``managers/scheduler_components/logprob_result_processor.py``,
``_process_input_token_logprobs``), and ``input_top_logprobs`` starts with null the same way. A
batch request returns a list of such objects, and so does a single prompt with
``sampling_params.n > 1`` (``managers/io_struct.py``, ``_handle_parallel_sampling``: ``n``
results per prompt, the samples of one prompt together). Text in the triples is null unless
``return_text_in_logprobs`` was set. ``finish_reason`` is null while a streamed request is still
running; a finished reply always has one.

A request aborted while still queued is answered by ``TokenizerManager._handle_abort_req``
(``managers/tokenizer_manager.py``) with ``meta_info = {"id", "finish_reason": {"type":
"abort", "message": "Abort in waiting queue"}, "e2e_latency", "completion_tokens": 0, ...}``:
no ``prompt_tokens``. That reply parses as an abort with ``prompt_tokens=None``; every other
reply must carry ``prompt_tokens``.

Anything else is a ``BackendProtocolError`` naming the URL, the field and what was found.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import BackendProtocolError

__all__ = [
    "SGLangReply",
    "TopLogprobs",
    "parallel_samples",
    "parse_batch_reply",
    "parse_generate_reply",
]

TopLogprobs = tuple[tuple[tuple[float, int], ...] | None, ...]


@dataclass(frozen=True, slots=True)
class SGLangReply:
    """One ``/generate`` result, parsed."""

    text: str
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...] | None
    input_token_logprobs: tuple[tuple[float | None, int], ...] | None
    input_top_logprobs: TopLogprobs | None
    output_top_logprobs: TopLogprobs | None
    finish_reason: Mapping[str, Any]
    prompt_tokens: int | None  # None only for a request aborted in the waiting queue
    completion_tokens: int
    rid: str | None
    weight_version: int | None = None  # see ``weight_version_of``

    @property
    def finish_type(self) -> str:
        return str(self.finish_reason.get("type"))


class _Reader:
    def __init__(self, url: str) -> None:
        self.url = url

    def fail(self, where: str, expected: str, found: Any) -> BackendProtocolError:
        shown = repr(found)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        return BackendProtocolError(
            f"{self.url}: /generate reply field {where} should be {expected}, got {shown}"
        )

    def int_(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, "an integer", value)
        return value

    def float_(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise self.fail(where, "a number", value)
        return float(value)

    def entries(self, value: Any, where: str) -> list[tuple[float | None, int]]:
        """``[logprob | null, token_id, text]`` triples."""
        if not isinstance(value, list):
            raise self.fail(where, "a list", value)
        out: list[tuple[float | None, int]] = []
        for i, item in enumerate(value):
            at = f"{where}[{i}]"
            if not isinstance(item, list | tuple) or len(item) not in (2, 3):
                raise self.fail(at, "a [logprob, token_id, text] triple", item)
            lp = None if item[0] is None else self.float_(item[0], f"{at}[0]")
            out.append((lp, self.int_(item[1], f"{at}[1]")))
        return out

    def scored(self, value: Any, where: str) -> list[tuple[float, int]]:
        """Triples whose logprob must be present."""
        out: list[tuple[float, int]] = []
        for i, (lp, tid) in enumerate(self.entries(value, where)):
            if lp is None:
                raise self.fail(f"{where}[{i}][0]", "a number", lp)
            out.append((lp, tid))
        return out

    def tops(self, value: Any, where: str) -> TopLogprobs:
        if not isinstance(value, list):
            raise self.fail(where, "a list", value)
        out: list[tuple[tuple[float, int], ...] | None] = []
        for i, position in enumerate(value):
            if position is None:
                out.append(None)
                continue
            out.append(tuple(self.scored(position, f"{where}[{i}]")))
        return tuple(out)


def weight_version_of(raw: Any) -> int | None:
    """The integer weight version a server reported, or None when it is unknown.

    SGLang 0.5.23 writes ``meta_info["weight_version"]`` as a string: the one given to
    ``--weight-version`` (``"default"`` when none was) or by the last weight update
    (``managers/tokenizer_manager.py``). A trainer that names versions by integers gets them
    back as ints; anything else (absent, ``"default"``, a non-integer name) is unknown, never
    guessed from the request.
    """
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw if raw >= 0 else None
    if isinstance(raw, str) and raw.isascii() and raw.isdecimal():
        return int(raw)
    return None


def parse_generate_reply(
    obj: Any, *, url: str, logprobs: bool, top_logprobs: bool = False
) -> SGLangReply:
    """Parse one (non-batch) ``/generate`` reply; ``logprobs`` says ``return_logprob`` was set."""
    r = _Reader(url)
    if not isinstance(obj, dict):
        raise r.fail("<body>", "a JSON object (was a batch sent?)", obj)
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise r.fail("meta_info", "an object", meta)
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or not isinstance(finish.get("type"), str):
        raise r.fail("meta_info.finish_reason", 'an object with a string "type"', finish)
    text = obj.get("text", "")
    if not isinstance(text, str):
        raise r.fail("text", "a string", text)
    rid = meta.get("id") if isinstance(meta.get("id"), str) else None
    aborted = finish["type"] == "abort"
    prompt_tokens = (
        None
        if aborted and "prompt_tokens" not in meta
        else r.int_(meta.get("prompt_tokens"), "meta_info.prompt_tokens")
    )
    completion_tokens = r.int_(meta.get("completion_tokens", 0), "meta_info.completion_tokens")

    out_pairs: list[tuple[float, int]] | None = None
    in_pairs: list[tuple[float | None, int]] | None = None
    in_top = out_top = None
    if logprobs and not (aborted and "output_token_logprobs" not in meta):
        out_pairs = r.scored(meta.get("output_token_logprobs"), "meta_info.output_token_logprobs")
        in_pairs = r.entries(meta.get("input_token_logprobs", []), "meta_info.input_token_logprobs")
        if top_logprobs:
            in_top = r.tops(meta.get("input_top_logprobs", []), "meta_info.input_top_logprobs")
            out_top = r.tops(meta.get("output_top_logprobs", []), "meta_info.output_top_logprobs")

    raw_ids = obj.get("output_ids")
    if raw_ids is not None:
        if not isinstance(raw_ids, list):
            raise r.fail("output_ids", "a list of token ids", raw_ids)
        output_ids = tuple(r.int_(t, f"output_ids[{i}]") for i, t in enumerate(raw_ids))
    elif out_pairs is not None:
        output_ids = tuple(tid for _, tid in out_pairs)
    else:
        output_ids = ()
    if out_pairs is not None:
        ids_from_logprobs = tuple(tid for _, tid in out_pairs)
        if ids_from_logprobs != output_ids:
            raise BackendProtocolError(
                f"{url}: output_token_logprobs name {len(ids_from_logprobs)} tokens that differ "
                f"from output_ids ({len(output_ids)} tokens)"
            )
    carries_ids = raw_ids is not None or out_pairs is not None
    if not aborted and carries_ids and completion_tokens != len(output_ids):
        raise BackendProtocolError(
            f"{url}: meta_info.completion_tokens is {completion_tokens} but the reply carries "
            f"{len(output_ids)} output tokens"
        )
    return SGLangReply(
        text=text,
        output_ids=output_ids,
        output_logprobs=None if out_pairs is None else tuple(lp for lp, _ in out_pairs),
        input_token_logprobs=None if in_pairs is None else tuple(in_pairs),
        input_top_logprobs=in_top,
        output_top_logprobs=out_top,
        finish_reason=finish,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        rid=rid,
        weight_version=weight_version_of(meta.get("weight_version")),
    )


def parse_batch_reply(
    obj: Any, *, url: str, size: int, logprobs: bool, top_logprobs: bool = False
) -> list[SGLangReply]:
    """A batch ``/generate`` reply: a list of ``size`` single replies, in request order."""
    if not isinstance(obj, list) or len(obj) != size:
        raise BackendProtocolError(
            f"{url}: a batch of {size} should get a list of {size} replies, got "
            f"{type(obj).__name__}{f' of {len(obj)}' if isinstance(obj, list) else ''}"
        )
    return [
        parse_generate_reply(o, url=url, logprobs=logprobs, top_logprobs=top_logprobs) for o in obj
    ]


def parallel_samples(sampling_params: Mapping[str, Any], *, url: str) -> int:
    """``sampling_params["n"]`` (1 when absent); ``ValueError`` unless an integer >= 1."""
    n = sampling_params.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{url}: sampling_params.n must be an integer >= 1, got {n!r}")
    return n
