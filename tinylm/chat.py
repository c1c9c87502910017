"""OpenAI ``/v1/chat/completions`` on top of the tinylm scheduler.

The request's ``messages`` and ``tools`` are rendered with the model's chat template, the
rendered prompt is generated like any ``/generate`` request, and the text is split into prose
and ``<tool_call>`` blocks (``tinylm.toolcalls``). The reply follows the OpenAI shape:
``choices[0].message`` with ``content`` (``null`` when the turn is only tool calls) and
``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments": <JSON text>}}``),
``finish_reason`` (``tool_calls`` when calls were parsed, else ``stop`` / ``length``; ``abort``
when the request was aborted, as SGLang reports it) and ``usage``.

Supported request fields: ``model`` (any), ``messages``, ``tools``, ``tool_choice`` (``auto`` or
``none``), ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``,
``seed``, ``n`` (1), ``stream`` (false). Anything else a client commonly sends is refused by name
rather than silently ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tinylm.sampling import SamplingParams
from tinylm.scheduler import GenerateOutput, GenerateRequest
from tinylm.toolcalls import split_tool_calls

__all__ = ["ChatError", "chat_completion"]

_DEFAULT_MAX_TOKENS = 512
_IGNORED = {"model", "user", "metadata", "parallel_tool_calls"}
_KNOWN = _IGNORED | {
    "messages",
    "tools",
    "tool_choice",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "stream",
}


class ChatError(ValueError):
    """The chat request is invalid; the message names the field."""


def _sampling(body: dict[str, Any]) -> SamplingParams:
    # The scheduler further caps max_new_tokens to what is left of the context.
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw: dict[str, Any] = {
        "max_new_tokens": _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "stop": body.get("stop"),
        "sampling_seed": body.get("seed"),
    }
    try:
        return SamplingParams.from_json(
            {k: v for k, v in raw.items() if v is not None}, where="request"
        )
    except ValueError as exc:
        raise ChatError(str(exc)) from exc


def chat_completion(
    body: dict[str, Any],
    *,
    tokenizer: Any,
    encode: Callable[[str], list[int]],
    new_rid: Callable[[], str],
    run: Callable[[GenerateRequest], GenerateOutput],
    model_name: str,
) -> dict[str, Any]:
    """Serve one chat completion; ``ChatError`` for a request that cannot be served."""
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ChatError(f"unsupported chat completion field(s): {', '.join(unknown)}")
    if body.get("stream"):
        raise ChatError("stream=true is not supported by tinylm")
    if body.get("n", 1) != 1:
        raise ChatError(f"n={body.get('n')!r} is not supported by tinylm (only 1)")
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ChatError("messages must be a non-empty list of objects with a 'role'")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ChatError("tools must be a list of objects")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise ChatError(f"tool_choice={choice!r} is not supported by tinylm (auto or none)")
    if choice == "none":
        tools = None
    try:
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja errors, bad message shapes
        raise ChatError(f"messages could not be rendered with the chat template: {exc}") from exc
    input_ids = encode(prompt)
    rid = new_rid()
    req = GenerateRequest(
        rid=rid,
        input_ids=tuple(input_ids),
        sampling=_sampling(body),
    )
    out = run(req)
    finish = out.meta_info["finish_reason"]["type"]
    message: dict[str, Any] = {"role": "assistant", "content": out.text}
    reason = {"stop": "stop", "length": "length"}.get(finish, finish)
    if tools:
        content, calls = split_tool_calls(out.text, id_prefix=f"call_{rid}_")
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
            if finish == "stop":
                reason = "tool_calls"
    prompt_tokens, completion_tokens = len(input_ids), len(out.output_ids)
    return {
        "id": f"chatcmpl-{rid}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
