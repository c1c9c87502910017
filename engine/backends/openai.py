"""``OpenAIBackend``: any OpenAI-compatible ``/v1/chat/completions`` server, text in and out.

For models reached through an API (or a scaffold's view of SGLang): ``messages`` and ``tools``
go in; text, structured ``tool_calls`` and ``usage`` come back. It has no capability of the
port (``engine.backends.base.Capabilities``): no token ids (``tokenize`` / ``decode`` /
``input_ids=`` raise ``NotImplementedError``), no scoring, abort, weight version or health;
``rid=`` is ignored.

``sampling_params`` uses the engine's (SGLang) names, translated here: ``max_new_tokens`` ->
``max_completion_tokens`` (the OpenAI API's current name, which reasoning models require and
SGLang and vLLM accept; ``OpenAIConfig.max_tokens_field="max_tokens"`` for a server that only
knows the older one), ``sampling_seed`` -> ``seed``; ``temperature``, ``top_p``, ``stop`` pass
through. A parameter with no chat-API equivalent is refused by name unless it is at its neutral
value, so the same ``sampling_params`` never silently means different things on two backends.

A 429 or 5xx reply is retried (``OpenAIConfig.status_retry``: 4 retries by default, waiting what
``Retry-After`` asks, else an exponential backoff, capped at 30 s; see ``_http.py``) before it
raises ``BackendHTTPError``; ``status_retry=None`` turns that off.

Reply handling: ``choices[0].message.content`` (``null`` allowed), ``tool_calls`` (arguments
kept as the JSON text the model wrote), ``refusal`` and ``reasoning_content`` (kept on the
result), ``finish_reason`` (``stop``, ``length``, ``tool_calls``; SGLang's ``abort`` gives an
empty aborted result; anything else ``error:<reason>``) and ``usage``. A reply of another shape
raises ``BackendProtocolError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from engine.backends._http import HTTPSettings, JSONClient, StatusRetry, check_base_url
from engine.backends.base import (
    FinishReason,
    GenerationResult,
    ModelBackend,
    ToolCall,
    Usage,
    error_finish_reason,
)
from engine.errors import BackendProtocolError, ConfigError

__all__ = ["OpenAIBackend", "OpenAIConfig", "to_chat_params"]

_RENAMED = {"max_new_tokens": "max_completion_tokens", "sampling_seed": "seed"}
_PASSED = {
    "temperature",
    "top_p",
    "stop",
    "max_completion_tokens",
    "seed",
    "presence_penalty",
    "frequency_penalty",
}
_NEUTRAL: dict[str, Any] = {
    "top_k": -1,
    "min_p": 0.0,
    "no_stop_trim": False,
    "skip_special_tokens": True,
    "ignore_eos": False,
    "n": 1,
    "stop_token_ids": None,
    "repetition_penalty": 1.0,
}


@dataclass(frozen=True, kw_only=True)
class OpenAIConfig:
    """``base_url`` ends before ``/chat/completions``, e.g. ``http://host:30000/v1``.

    ``max_tokens_field`` names the length limit sent (module docstring); ``status_retry`` is
    how 429 / 5xx replies are retried (None: not at all).
    """

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    http: HTTPSettings = field(default_factory=HTTPSettings)
    max_tokens_field: Literal["max_completion_tokens", "max_tokens"] = "max_completion_tokens"
    status_retry: StatusRetry | None = field(default_factory=StatusRetry)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "base_url", check_base_url(self.base_url, what="OpenAIConfig.base_url")
        )
        if self.max_tokens_field not in ("max_completion_tokens", "max_tokens"):
            raise ConfigError(
                "OpenAIConfig.max_tokens_field must be 'max_completion_tokens' or 'max_tokens', "
                f"got {self.max_tokens_field!r}"
            )


def to_chat_params(
    sampling_params: Mapping[str, Any], *, max_tokens_field: str = "max_completion_tokens"
) -> dict[str, Any]:
    """Engine sampling params as chat fields; ``ValueError`` names an untranslatable one."""
    out: dict[str, Any] = {}
    for key, value in sampling_params.items():
        name = _RENAMED.get(key, key)
        if name in ("max_tokens", "max_completion_tokens"):
            name = "max_completion_tokens"
        if name in _PASSED:
            if value is not None:
                out[name] = value
        elif key in _NEUTRAL:
            if value not in (_NEUTRAL[key], None, []):
                raise ValueError(
                    f"sampling parameter {key}={value!r} has no chat-completions equivalent"
                )
        else:
            raise ValueError(f"unknown sampling parameter {key!r}")
    if max_tokens_field != "max_completion_tokens" and "max_completion_tokens" in out:
        out[max_tokens_field] = out.pop("max_completion_tokens")
    return out


class OpenAIBackend(ModelBackend):
    """Chat-level ``ModelBackend`` (see the module docstring)."""

    def __init__(
        self, *, config: OpenAIConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.config = config
        self.base_url = config.base_url
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else None
        self._http = JSONClient(
            base_url=config.base_url,
            settings=config.http,
            transport=transport,
            headers=headers,
            status_retry=config.status_retry,
        )
        self._url = config.base_url + "/chat/completions"

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        if input_ids is not None:
            raise NotImplementedError(f"{self!r} takes messages, not input_ids (no token_ids)")
        if not messages:
            raise ValueError("OpenAIBackend.generate needs a non-empty messages list")
        payload: dict[str, Any] = {
            "model": self.config.model,
            "messages": [dict(m) for m in messages],
            **to_chat_params(sampling_params, max_tokens_field=self.config.max_tokens_field),
        }
        if tools:
            payload["tools"] = [dict(t) for t in tools]
        return self._parse(await self._http.post("/chat/completions", payload))

    def _fail(self, where: str, expected: str, found: Any) -> BackendProtocolError:
        return BackendProtocolError(
            f"{self._url}: reply field {where} should be {expected}, got {repr(found)[:120]}"
        )

    def _parse(self, body: Any) -> GenerationResult:
        if not isinstance(body, dict):
            raise self._fail("<body>", "a JSON object", body)
        choices = body.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._fail("choices", "a non-empty list of objects", choices)
        choice = choices[0]
        message = choice.get("message")
        if not isinstance(message, dict):
            raise self._fail("choices[0].message", "an object", message)
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise self._fail("choices[0].message.content", "a string or null", content)
        calls = self._tool_calls(message.get("tool_calls"))
        usage = self._usage(body.get("usage"))
        refusal = self._optional_text(message, "refusal")
        reasoning = self._optional_text(message, "reasoning_content")
        reason = choice.get("finish_reason")
        if reason == FinishReason.ABORT:
            return GenerationResult(text="", finish_reason=FinishReason.ABORT, usage=usage)
        known = {
            "stop": FinishReason.STOP,
            "length": FinishReason.LENGTH,
            "tool_calls": FinishReason.TOOL_CALLS,
            "function_call": FinishReason.TOOL_CALLS,
        }
        finish = known.get(reason) if isinstance(reason, str) else None
        return GenerationResult(
            text=content or "",
            tool_calls=calls,
            finish_reason=finish or error_finish_reason(str(reason)),
            usage=usage,
            refusal=refusal,
            reasoning_content=reasoning,
        )

    def _optional_text(self, message: dict[str, Any], key: str) -> str | None:
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise self._fail(f"choices[0].message.{key}", "a string or null", value)
        return value

    def _tool_calls(self, raw: Any) -> tuple[ToolCall, ...] | None:
        if raw is None or raw == []:
            return None
        if not isinstance(raw, list):
            raise self._fail("choices[0].message.tool_calls", "a list", raw)
        calls = []
        for i, call in enumerate(raw):
            where = f"choices[0].message.tool_calls[{i}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise self._fail(where, "an object with function.name", call)
            args = fn.get("arguments", "{}")
            if isinstance(args, dict):  # some servers send the object itself
                args = json.dumps(args, ensure_ascii=False)
            if not isinstance(args, str):
                raise self._fail(f"{where}.function.arguments", "a JSON string", args)
            call_id = call.get("id")
            calls.append(
                ToolCall(
                    name=fn["name"],
                    arguments=args,
                    id=call_id if isinstance(call_id, str) else f"call_{i}",
                )
            )
        return tuple(calls)

    def _usage(self, raw: Any) -> Usage | None:
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise self._fail("usage", "an object", raw)
        prompt, completion = raw.get("prompt_tokens"), raw.get("completion_tokens")
        if not isinstance(prompt, int) or not isinstance(completion, int):
            raise self._fail("usage", "integer prompt_tokens and completion_tokens", raw)
        return Usage(prompt_tokens=prompt, completion_tokens=completion)

    async def aclose(self) -> None:
        await self._http.aclose()
