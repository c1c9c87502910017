"""``POST /generate`` with ``"stream": true``: the chunks SGLang 0.5.23 sends, one request each.

Sources, under ``python/sglang/srt/``:

- ``entrypoints/http_server.py``, ``serve_generate_request`` (``stream_results``): the reply is
  ``text/event-stream``, one ``data: <json>\\n\\n`` event per output and a last
  ``data: [DONE]\\n\\n``. A ``ValueError`` raised while the request is set up (a prompt longer
  than the context, a ``logprob_start_len`` past the prompt) becomes one event
  ``{"error": {"message", "type": "invalid_request_error", "code": 400, "retryable": false}}``
  before ``[DONE]``: the status is already 200 by then (``error_event``).
- ``managers/tokenizer_manager.py``, ``_handle_batch_output``: with the default
  ``stream_output`` every chunk holds the whole output so far (``text``, ``output_ids``) and a
  ``meta_info`` whose ``finish_reason`` is null until the last chunk, which is the finished
  reply itself. With ``--incremental-streaming-output`` the chunks are disjoint segments: the
  new text, the new ``output_ids``, and only the new tokens' ``output_token_logprobs`` /
  ``output_top_logprobs`` (``_slice_streaming_output_meta_info``; ``input_token_logprobs`` and
  ``output_token_logprobs_length`` stay whole). ``_stream_one_response``: outputs the client
  has not read yet are coalesced into one chunk (the latest, or the concatenated segments);
  ``response_sent_to_client_ts`` is in the first chunk only.
- ``_stream_batch_responses``: a batch (a list of prompts, or ``sampling_params.n > 1``)
  streams its requests' chunks interleaved as they come, each with ``"index"``, the request's
  place in the batch.
- ``managers/scheduler_components/output_streamer.py``, ``accept``: a streamed request sends a
  chunk every ``stream_interval`` tokens (``sampling_params.stream_interval``, else
  ``--stream-interval``, default 1), its first token at once; a step after which the text ends
  in the beginning of a stop string sends nothing (``Req.check_match_stop_str_prefix``). Text
  that ends inside an incomplete UTF-8 sequence is held back as the detokenizer holds it.

An aborted request's last chunk carries ``finish_reason.type == "abort"`` and what it had
generated. ``server.py`` runs the requests on the scheduler and feeds ``StreamChunks``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tinylm.replies import logprob_fields, meta_info
from tinylm.scheduler import GenerateOutput, GenerateRequest, Pending, TokenEvent

__all__ = ["DONE", "ChunkSettings", "StreamChunks", "error_event", "event"]

DONE = b"data: [DONE]\n\n"
# tokenizer_manager._INCREMENTAL_STREAMING_META_INFO_KEYS that tinylm produces
_SLICED = ("output_token_logprobs", "output_top_logprobs")


def event(body: Any) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def error_event(message: str, code: int) -> bytes:
    """``stream_results``' event for a request that failed after the stream began."""
    return event(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "code": code,
                "retryable": False,
            }
        }
    )


@dataclass(frozen=True, kw_only=True)
class ChunkSettings:
    """What shapes a server's stream chunks."""

    incremental: bool  # --incremental-streaming-output
    interval: int  # --stream-interval
    decode: Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text
    token_text: Callable[[int], str]  # for return_text_in_logprobs
    weight_version: Callable[[], str]  # the version loaded now


class StreamChunks:
    """The chunks of one streamed request, from its tokens as the scheduler draws them."""

    def __init__(
        self, req: GenerateRequest, pending: Pending, settings: ChunkSettings, index: int | None
    ) -> None:
        self.req = req
        self.pending = pending
        self._settings = settings
        self._index = index
        self._interval = req.sampling.stream_interval or settings.interval
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[tuple[tuple[float, int], ...]] = []
        self._sent = 0  # output ids the client has been sent
        self._sent_text = ""
        self._chunks = 0

    def step(self, events: Sequence[TokenEvent]) -> dict[str, Any] | None:
        """The chunk to send after ``events`` (None: nothing to send yet)."""
        for e in events:
            self._ids.append(e.token_id)
            if e.logprob is not None:
                self._logprobs.append(e.logprob)
            if e.top is not None:
                self._top.append(e.top)
        unsent = len(self._ids) - self._sent
        if unsent == 0 or not (self._interval == 1 or unsent >= self._interval or self._sent == 0):
            return None
        text = self._settings.decode(self._ids, self.req.sampling.skip_special_tokens)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence waits for its next token
        if self._holds_stop_prefix(text):
            return None
        req = self.req
        logprobs = None
        if req.return_logprob:
            inputs, input_top = self.pending.input_logprobs
            logprobs = logprob_fields(
                top_logprobs_num=req.top_logprobs_num,
                input_logprobs=inputs,
                input_top=input_top,
                output_logprobs=list(zip(self._logprobs, self._ids, strict=False)),
                output_top=self._top,
                text_of=self._settings.token_text if req.return_text_in_logprobs else None,
            )
        meta = meta_info(
            rid=req.rid,
            finish_reason=None,
            prompt_tokens=len(req.input_ids),
            completion_tokens=len(self._ids),
            weight_version=self._settings.weight_version(),
            logprobs=logprobs,
        )
        return self._chunk(text, list(self._ids), meta)

    def final(self, output: GenerateOutput) -> dict[str, Any]:
        """The last chunk: the finished reply (its new part, in incremental mode)."""
        meta = dict(output.meta_info)
        if self._chunks:
            meta.pop("response_sent_to_client_ts", None)
        return self._chunk(output.text, list(output.output_ids), meta)

    def _chunk(self, text: str, ids: list[int], meta: dict[str, Any]) -> dict[str, Any]:
        sent, self._sent = self._sent, len(ids)
        sent_text, self._sent_text = self._sent_text, text
        if self._chunks:
            meta.pop("response_sent_to_client_ts", None)
        elif "response_sent_to_client_ts" not in meta:
            meta["response_sent_to_client_ts"] = time.time()
        self._chunks += 1
        if self._settings.incremental:
            text, ids = text[len(sent_text) :], ids[sent:]
            for key in _SLICED:
                if key in meta:
                    meta[key] = meta[key][sent:]
        chunk: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
        if self._index is not None:
            chunk["index"] = self._index
        return chunk

    def _holds_stop_prefix(self, text: str) -> bool:
        """SGLang sends nothing while the text ends in the start of a stop string."""
        for stop in self.req.sampling.stop:
            if stop in text or any(
                text.endswith(stop[:i]) for i in range(1, min(len(text), len(stop)) + 1)
            ):
                return True
        return False
