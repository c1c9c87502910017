"""``SGLangBackend``: the student policy's token-in / token-out path over SGLang's native API.

``generate`` posts ``{"input_ids", "sampling_params", "return_logprob": true}`` to SGLang's
native ``/generate`` and returns the exact sampled token ids with their logprobs, read from
``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples; see
``sglang_protocol.py``). No re-tokenisation and no chat-template round trip happen on the way
back, so the tokens the model emitted are the tokens training sees.

- The request streams (``"stream": true``; ``entrypoints/http_server.py``,
  ``serve_generate_request``): SGLang sends ``data: <chunk>`` events with the output so far
  and ``data: [DONE]``, and the last chunk is the finished reply, exactly what the same
  request without ``stream`` returns (``managers/tokenizer_manager.py``,
  ``_handle_batch_output``). Only that chunk is parsed; the others are progress. A stream
  silent for ``stall_s`` whose server also fails ``/health_generate`` raises
  ``ServerStalled``: the call is given up and its connection closed, which SGLang takes as the
  client leaving and aborts the request (``create_abort_task``); the caller aborts the exact
  rid as well. ``stall_s=None`` sends one plain POST instead.

- ``messages`` are accepted too when a tokenizer is configured: they are rendered with its chat
  template (``add_generation_prompt``) and tokenized here, then sent as ``input_ids``.
- A reply whose ``finish_reason.type`` is ``abort`` becomes a result with
  ``finish_reason="abort"`` holding the partial output SGLang sends for a request aborted
  while running (``output_ids`` and their ``output_token_logprobs``, sampled before the abort),
  so the turn can be continued from them (``engine/backends/pool.py``); it is empty when the
  request was aborted while queued and SGLang's reply has no ``prompt_tokens`` (the usage
  then counts the prompt that was sent) or when the reply carries no logprobs. Other finish
  types map to ``stop`` / ``length``, anything unknown to ``error:<type>``.
- ``sampling_params["n"] > 1`` makes SGLang answer a list of ``n`` results: ``generate_samples``
  returns them all (``generate`` itself returns one result, so it refuses ``n > 1``). SGLang
  0.5.23 gives each parallel sample a fresh uuid as its rid (``TokenizerManager.
  _handle_batch_request``), so ``abort(rid)`` does not reach them there; tinylm names them
  ``{rid}_{i}``, which it does. ``abort(rid)`` matches rids by prefix on both.
- ``score`` force-decodes a fixed response (one greedy step over ``prompt + response`` with
  ``logprob_start_len = len(prompt) - 1``, the teacher's Role-B payload) and returns the
  logprob, and optionally the top-k, of every response token. An aborted scoring request
  raises ``GenerationAborted``: a score must never silently come back empty.
- ``abort(rid)`` posts ``/abort_request``; pass ``rid=`` to ``generate`` to be able to.
- ``weight_version()`` reads ``/get_model_info``; ``health()`` GETs ``/health`` (with
  ``generate=True``, ``/health_generate``, which SGLang answers after one generation step).

It has every capability of the port (``engine.backends.base.Capabilities``).

The tokenizer, when given as a path, is loaded with ``AutoTokenizer.from_pretrained(path,
local_files_only=True)``: backends never download anything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine.backends._http import HTTPSettings, JSONClient, check_base_url
from engine.backends.base import (
    Capabilities,
    FinishReason,
    ForceDecodeScore,
    GenerationResult,
    ModelBackend,
    Usage,
    error_finish_reason,
)
from engine.backends.sglang_protocol import (
    SGLangReply,
    parallel_samples,
    parse_batch_reply,
    parse_generate_reply,
    weight_version_of,
)
from engine.errors import BackendError, BackendProtocolError, ConfigError, GenerationAborted

__all__ = ["SGLangBackend", "SGLangConfig", "load_tokenizer"]

_SGLANG_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens when a request sets none
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


@dataclass(frozen=True, kw_only=True)
class SGLangConfig:
    """Where the SGLang server is and how to talk to it.

    ``url`` is the server (or router) base URL, e.g. ``http://10.0.0.5:30000``.
    ``tokenizer_path`` is a local Hugging Face folder; without it ``tokenize``, ``decode`` and
    ``messages=`` are unavailable. ``stall_s``: a generation streams, and one that receives
    nothing for that long while the server fails ``/health_generate`` within
    ``health_timeout_s`` is stalled (None, the default: no stream, one plain POST; a worker's
    policy servers stream, ``ROLLOUT_STALL_S``).
    """

    url: str
    tokenizer_path: str | Path | None = None
    http: HTTPSettings = field(default_factory=HTTPSettings)
    stall_s: float | None = None
    health_timeout_s: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", check_base_url(self.url, what="SGLangConfig.url"))
        if self.stall_s is not None and self.stall_s <= 0:
            raise ConfigError(f"SGLangConfig.stall_s must be > 0 (or None), got {self.stall_s}")
        if self.health_timeout_s <= 0:
            raise ConfigError(
                f"SGLangConfig.health_timeout_s must be > 0, got {self.health_timeout_s}"
            )


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer`` from a local folder only; ``ConfigError`` naming the path otherwise."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load a tokenizer from {path} (local files only): {exc}") from exc


class SGLangBackend(ModelBackend):
    """Token-level ``ModelBackend`` over SGLang's native API (see the module docstring)."""

    capabilities = Capabilities(
        token_ids=True, scoring=True, abort=True, weight_version=True, health=True
    )

    def __init__(
        self,
        *,
        config: SGLangConfig,
        tokenizer: Any | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        if tokenizer is None and config.tokenizer_path is not None:
            tokenizer = load_tokenizer(config.tokenizer_path)
        self.tokenizer = tokenizer
        self.base_url = config.url
        self._http = JSONClient(base_url=config.url, settings=config.http, transport=transport)
        self._generate_url = config.url + "/generate"
        self._health_check: asyncio.Future[bool] | None = None  # shared by silent streams

    # -- tokenizer ---------------------------------------------------------------------------

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ConfigError(
                f"SGLangBackend({self.config.url}).{what} needs a tokenizer: set "
                "SGLangConfig.tokenizer_path or pass tokenizer="
            )
        return self.tokenizer

    def tokenize(self, text: str) -> list[int]:
        return list(self._need_tokenizer("tokenize")(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._need_tokenizer("decode").decode(list(token_ids), skip_special_tokens=True))

    def render_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt token ids for ``messages`` (chat template with the generation prompt)."""
        tok = self._need_tokenizer("render_messages")
        text = tok.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=True,
            tokenize=False,
        )
        return self.tokenize(str(text))

    # -- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        """Sample a continuation; ``tools`` only matter with ``messages`` (they are rendered)."""
        if parallel_samples(sampling_params, url=self._generate_url) > 1:
            raise ValueError(
                "SGLangBackend.generate returns one result; use generate_samples for "
                "sampling_params.n > 1"
            )
        (result,) = await self.generate_samples(
            input_ids=input_ids,
            messages=messages,
            tools=tools,
            sampling_params=sampling_params,
            rid=rid,
        )
        return result

    async def generate_samples(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> list[GenerationResult]:
        """``sampling_params["n"]`` (default 1) samples of one prompt, in SGLang's order."""
        n = parallel_samples(sampling_params, url=self._generate_url)
        if (input_ids is None) == (messages is None):
            raise ValueError("SGLangBackend.generate needs exactly one of input_ids and messages")
        ids = (
            list(input_ids)
            if input_ids is not None
            else self.render_messages(messages or [], tools)
        )
        payload: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
        }
        if rid is not None:
            payload["rid"] = rid
        if n == 1 and self.config.stall_s is not None:
            replies = [await self._streamed(payload, self.config.stall_s)]
        elif n == 1:
            replies = [await self.generate_raw(payload)]
        else:
            body = await self._http.post("/generate", payload)
            replies = parse_batch_reply(body, url=self._generate_url, size=n, logprobs=True)
        return [self._result(reply, len(ids)) for reply in replies]

    @staticmethod
    def _result(reply: SGLangReply, prompt_len: int) -> GenerationResult:
        usage = Usage(
            prompt_tokens=prompt_len if reply.prompt_tokens is None else reply.prompt_tokens,
            completion_tokens=reply.completion_tokens,
        )
        if reply.finish_type == FinishReason.ABORT:
            partial = reply.output_logprobs is not None
            return GenerationResult(
                text=reply.text if partial else "",
                token_ids=reply.output_ids if partial else (),
                logprobs=reply.output_logprobs if reply.output_logprobs is not None else (),
                finish_reason=FinishReason.ABORT,
                usage=usage,
                weight_version=reply.weight_version,
            )
        assert reply.output_logprobs is not None  # return_logprob was set
        return GenerationResult(
            text=reply.text,
            token_ids=reply.output_ids,
            logprobs=reply.output_logprobs,
            finish_reason=_FINISH.get(reply.finish_type) or error_finish_reason(reply.finish_type),
            usage=usage,
            weight_version=reply.weight_version,
        )

    async def _streamed(self, payload: dict[str, Any], stall_s: float) -> SGLangReply:
        """One generation over the streamed ``/generate``: its last chunk is the finished
        reply, parsed like the plain one. A chunk every eighth of the token budget (SGLang
        sends the output so far in each, so fewer chunks carry fewer bytes); silence past
        ``stall_s`` is checked with ``/health_generate`` before the call is given up."""
        params = payload["sampling_params"]
        if params.get("stream_interval") is None:
            budget = params.get("max_new_tokens") or _SGLANG_MAX_NEW_TOKENS
            payload["sampling_params"] = {**params, "stream_interval": max(1, budget // 8)}
        payload["stream"] = True
        body = await self._http.post_events(
            "/generate", payload, silence_s=stall_s, alive=self._answers_health
        )
        return parse_generate_reply(body, url=self._generate_url, logprobs=True)

    async def _answers_health(self) -> bool:
        """Whether the server answers ``/health_generate`` within ``health_timeout_s``: one
        check at a time, shared by every call that went silent meanwhile."""
        check = self._health_check
        if check is None or check.done():
            check = self._health_check = asyncio.ensure_future(self._check_health())
        return await asyncio.shield(check)

    async def _check_health(self) -> bool:
        try:
            async with asyncio.timeout(self.config.health_timeout_s):
                await self.health(generate=True)
        except (TimeoutError, BackendError):
            return False
        return True

    async def generate_raw(self, payload: Mapping[str, Any]) -> SGLangReply:
        """POST one (non-batch) ``/generate`` payload and parse the reply strictly."""
        body = await self._http.post("/generate", payload)
        return parse_generate_reply(
            body,
            url=self._generate_url,
            logprobs=bool(payload.get("return_logprob")),
            top_logprobs=int(payload.get("top_logprobs_num") or 0) > 0,
        )

    async def score(
        self,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        *,
        top_logprobs_num: int = 0,
    ) -> ForceDecodeScore:
        """Logprob (and top-K) of each ``response_ids`` token given everything before it."""
        if not prompt_ids:
            raise ValueError("score needs a non-empty prompt: the first token has no logprob")
        if top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
        if not response_ids:
            return ForceDecodeScore((), (), (), ())
        payload: dict[str, Any] = {
            "input_ids": [*prompt_ids, *response_ids],
            "sampling_params": {
                "max_new_tokens": 1,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "no_stop_trim": True,
            },
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
        }
        if top_logprobs_num:
            payload["top_logprobs_num"] = top_logprobs_num
        reply = await self.generate_raw(payload)
        if reply.finish_type == FinishReason.ABORT:
            raise GenerationAborted(
                f"{self._generate_url}: force-decode of {len(response_ids)} tokens was aborted: "
                f"{reply.finish_reason.get('message', '')}"
            )
        return self._read_score(reply, list(response_ids), top_logprobs_num)

    def _read_score(self, reply: SGLangReply, response: list[int], k: int) -> ForceDecodeScore:
        entries = reply.input_token_logprobs or ()
        # Entry 0 is the last prompt token (logprob_start_len = len(prompt) - 1); the rest are
        # the response tokens, in order.
        if len(entries) != len(response) + 1:
            raise BackendProtocolError(
                f"{self._generate_url}: force-decode of {len(response)} tokens returned "
                f"{len(entries)} input_token_logprobs, expected {len(response) + 1}"
            )
        scored = [tid for _, tid in entries[1:]]
        if scored != response:
            at = next(i for i, (a, b) in enumerate(zip(scored, response, strict=True)) if a != b)
            raise BackendProtocolError(
                f"{self._generate_url}: force-decode scored token {scored[at]} at response "
                f"position {at}, but {response[at]} was sent"
            )
        logprobs: list[float] = []
        for i, (lp, _) in enumerate(entries[1:]):
            if lp is None:
                raise BackendProtocolError(
                    f"{self._generate_url}: input_token_logprobs[{i + 1}] has no logprob"
                )
            logprobs.append(lp)
        top_ids: list[tuple[int, ...]] = []
        top_lps: list[tuple[float, ...]] = []
        if k:
            tops = reply.input_top_logprobs or ()
            if len(tops) != len(entries):
                raise BackendProtocolError(
                    f"{self._generate_url}: {len(tops)} input_top_logprobs for "
                    f"{len(entries)} scored positions"
                )
            for i, top in enumerate(tops[1:]):
                if top is None:
                    raise BackendProtocolError(
                        f"{self._generate_url}: input_top_logprobs[{i + 1}] is null"
                    )
                top_ids.append(tuple(tid for _, tid in top))
                top_lps.append(tuple(lp for lp, _ in top))
        return ForceDecodeScore(
            tuple(response), tuple(logprobs), tuple(top_ids), tuple(top_lps), reply.weight_version
        )

    async def abort(self, rid: str | None = None) -> None:
        """Abort request ``rid`` on the server, or every request when ``rid`` is None."""
        await self._http.post(
            "/abort_request", {"abort_all": True} if rid is None else {"rid": rid}
        )

    async def weight_version(self) -> int | None:
        """The version ``/get_model_info`` reports (None: unknown, e.g. SGLang's "default")."""
        body: Any = await self._http.get("/get_model_info")
        if not isinstance(body, dict):
            raise BackendProtocolError(
                f"{self.base_url}/get_model_info: expected a JSON object, got "
                f"{type(body).__name__}"
            )
        return weight_version_of(body.get("weight_version"))

    async def health(self, *, generate: bool = False) -> None:
        """Return once the server answers ``/health`` (``/health_generate``); else raise."""
        await self._http.get("/health_generate" if generate else "/health")

    async def aclose(self) -> None:
        if self._health_check is not None:
            self._health_check.cancel()
        await self._http.aclose()
