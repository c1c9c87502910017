"""OpenAI ``/v1/chat/completions`` on top of the tinylm scheduler, shaped as SGLang serves it.

The request's ``messages`` and ``tools`` are rendered with the model's chat template, the
rendered prompt is generated like any ``/generate`` request, and the text is split into prose
and ``<tool_call>`` blocks (``tinylm.toolcalls``). The reply follows the OpenAI shape as SGLang
0.5.23 writes it (``entrypoints/openai/serving_chat.py``, ``_build_chat_response``):
``choices[i].message`` with ``content`` and ``tool_calls`` (``{"id", "type": "function",
"function": {"name", "arguments": <JSON text>}}``), ``finish_reason`` (``tool_calls`` when calls
were parsed, else ``stop`` / ``length``; ``abort`` when the request was aborted), ``matched_stop``,
``logprobs`` and ``usage``.

The request is read as SGLang's ``ChatCompletionRequest`` (``entrypoints/openai/protocol.py``)
reads it, so what an OpenAI client or ``sglang-router`` sends is accepted:

- honoured: ``messages`` (roles ``system``, ``developer`` (rendered as ``system``), ``user``,
  ``assistant``, ``tool``; ``content`` a string or a list of ``text`` parts, joined with a space
  as SGLang does for a string-content template), ``tools``, ``tool_choice`` (``auto``, ``none``,
  ``required`` or ``{"type": "function", "function": {"name": ...}}``), ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``stop``,
  ``stop_token_ids``, ``seed``, ``n``, ``logprobs`` / ``top_logprobs``, ``stream`` /
  ``stream_options.include_usage``, ``ignore_eos``, ``no_stop_trim``, ``skip_special_tokens``,
  ``continue_final_message``, ``chat_template_kwargs``, ``rid``;
- accepted: ``response_format`` (``text``, ``json_object``, ``json_schema`` with a ``name``,
  validated as SGLang validates it; tinylm has no grammar backend, so the output is not
  constrained), ``model``, ``user``, ``parallel_tool_calls``, ``separate_reasoning`` /
  ``stream_reasoning`` (tinylm has no reasoning parser, so ``reasoning_content`` is never set),
  and the routing fields a router adds (``bootstrap_*``, ``routed_dp_rank``, ...);
- every other field of SGLang's request model is accepted at its default value and refused
  by name otherwise (``return_hidden_states=true``, ``regex``, ``lora_path``, penalties...): a
  setting tinylm cannot honour must not be silently dropped. A field SGLang does not know is
  refused by name too (SGLang ignores it).

``tool_choice="required"`` and a named function are honoured the way a grammar would start
them: the assistant turn is begun with ``<tool_call>`` (and, for a named function, its name),
and the model writes the rest. tinylm cannot constrain the rest, so a tiny model may still write
a malformed call; it is then returned as text, visible to the client.

``stream=true`` answers ``text/event-stream`` chunks in SGLang's order
(``_generate_chat_stream``): per choice a first chunk with ``role: "assistant"`` and empty
content, the content (with its logprobs) or the tool calls, then a chunk with an empty delta and
the ``finish_reason`` (and ``matched_stop``); a ``usage`` chunk with no choices when
``stream_options.include_usage`` is set; then ``data: [DONE]``. A single plain answer (``n=1``,
no tools, no stop strings) is streamed while it is generated, a chunk per decoded piece of text
(a token that ends inside a UTF-8 character waits for the next). Otherwise the answer is
generated whole first, because its text is only final then (a stop string is cut off, tool
calls are parsed), and sent as the same chunks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from tinylm.sampling import SamplingParams
from tinylm.scheduler import GenerateOutput, GenerateRequest, TokenEvent
from tinylm.toolcalls import OPEN, split_tool_calls

Follow = AsyncIterator[tuple[list[TokenEvent], GenerateOutput | None]]

__all__ = ["ChatError", "ChatReply", "chat_completion", "sse_events"]

_DEFAULT_MAX_TOKENS = 512

# SGLang 0.5.23 entrypoints/openai/protocol.py, ChatCompletionRequest (and PDRoutingFields):
# fields read and honoured here, fields accepted as they come, and fields accepted only at
# their default value.
_HONOURED = {
    "messages", "tools", "tool_choice", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "n", "logprobs",
    "top_logprobs", "stream", "stream_options", "ignore_eos", "no_stop_trim",
    "skip_special_tokens", "continue_final_message", "chat_template_kwargs", "rid",
    "response_format",
}  # fmt: skip
_ACCEPTED = {
    "model", "user", "parallel_tool_calls", "separate_reasoning", "stream_reasoning",
    "reasoning_effort", "bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
    "disagg_prefill_dp_rank", "data_parallel_rank", "priority", "extra_key", "cache_salt",
    "session_id", "metadata", "return_prompt_token_ids", "return_token_ids",
}  # fmt: skip
_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": None,
    "min_tokens": 0,
    "regex": None,
    "ebnf": None,
    "stop_regex": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "routed_experts_start_len": 0,
    "return_cached_tokens_details": False,
    "return_spec_tokens_details": False,
    "return_meta_info": False,
    "return_input_ids_in_sglext": False,
    "return_output_ids_in_sglext": False,
    "return_sampling_mask": False,
    "sampling_logprobs_mode": None,
    "return_flat_raw_output_top_logprobs": False,
    "thinking": None,
    "task": None,
    "lora_path": None,
    "session_params": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "use_audio_in_video": False,
    "images_config": None,
    "video_config": None,
    "mm_processor_kwargs": None,
    "custom_logit_processor": None,
    "custom_params": None,
    "watermark": None,
    "input_ids": None,
}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ChatError(ValueError):
    """The chat request is invalid; the message names the field."""


@dataclass(frozen=True, slots=True)
class ChatReply:
    """A chat completion: one JSON ``body``, or the SSE ``events`` of a streamed one."""

    body: dict[str, Any] | None = None
    events: Iterable[str] | AsyncIterator[str] | None = None


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _HONOURED - _ACCEPTED - set(_DEFAULTS))
    if unknown:
        raise ChatError(f"unsupported chat completion field(s): {', '.join(unknown)}")
    for key, default in _DEFAULTS.items():
        value = body.get(key, default)
        if value != default and value not in (None, [], {}):
            raise ChatError(f"{key}={value!r} is not supported by tinylm (only {default!r})")


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatError(f"{key} must be a boolean, got {value!r}")
    return value


def _int_field(body: dict[str, Any], key: str, default: int, *, low: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ChatError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def _sampling(body: dict[str, Any]) -> SamplingParams:
    # The scheduler further caps max_new_tokens to what is left of the context.
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw: dict[str, Any] = {
        "max_new_tokens": _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "sampling_seed": body.get("seed"),
        "ignore_eos": body.get("ignore_eos"),
        "no_stop_trim": body.get("no_stop_trim"),
        "skip_special_tokens": body.get("skip_special_tokens"),
    }
    try:
        return SamplingParams.from_json(
            {k: v for k, v in raw.items() if v is not None}, where="request"
        )
    except ValueError as exc:
        raise ChatError(str(exc)) from exc


def _content(message: dict[str, Any], i: int) -> Any:
    content = message.get("content")
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatError(
                f"messages[{i}].content[{j}]: tinylm is a text-only model, it takes 'text' "
                f"parts only, got {kind!r}"
            )
        if not isinstance(part.get("text"), str):
            raise ChatError(f"messages[{i}].content[{j}].text must be a string")
        texts.append(part["text"])
    return " ".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ChatError("messages must be a non-empty list of objects with a 'role'")
    out = []
    for i, message in enumerate(messages):
        role = message["role"].lower()
        if role not in _ROLES:
            raise ChatError(
                f"messages[{i}].role: unknown role {message['role']} (tinylm knows "
                f"{', '.join(sorted(_ROLES))})"
            )
        # OpenAI's developer role is the system prompt of newer models.
        out.append({**message, "role": "system" if role == "developer" else role,
                    "content": _content(message, i)})  # fmt: skip
    return out


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """``None`` (auto), ``"none"``, ``"required"`` or the name of the function to call."""
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return None
    if choice in ("none", "required"):
        if choice == "required" and not tools:
            raise ChatError('tool_choice="required" needs tools')
        return str(choice)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") == "function" and isinstance(name, str) and name:
            known = [
                (t.get("function") or {}).get("name") for t in tools or [] if isinstance(t, dict)
            ]
            if name not in known:
                raise ChatError(f"tool_choice names function {name!r}, which is not in tools")
            return name
    raise ChatError(
        f"tool_choice must be 'auto', 'none', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
    )


def _response_format(body: dict[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema", "structural_tag"):
        raise ChatError(
            "response_format.type must be 'text', 'json_object', 'json_schema' or "
            f"'structural_tag', got {fmt!r}"
        )
    if kind == "json_schema":
        schema = fmt.get("json_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
            raise ChatError("response_format.json_schema must be an object with a string 'name'")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether a usage chunk is wanted."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ChatError(f"stream_options must be an object, got {options!r}")
    return stream and bool(options.get("include_usage"))  # SGLang ignores it without stream


async def chat_completion(
    body: dict[str, Any],
    *,
    tokenizer: Any,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
    new_rid: Callable[[], str],
    run: Callable[[list[GenerateRequest]], Awaitable[list[GenerateOutput]]],
    model_name: str,
    decode_text: Callable[[Sequence[int], bool], str] | None = None,
    follow: Callable[[GenerateRequest], Awaitable[Follow]] | None = None,
) -> ChatReply:
    """Serve one chat completion; ``ChatError`` for a request that cannot be served.

    ``decode`` shows one token as logprobs name it; ``run`` generates requests to the end;
    ``follow`` (with ``decode_text(ids, skip_special_tokens)``) submits one ``stream`` request
    and returns an iterator of its tokens as they come: without both, streams are generated
    whole first."""
    _check_fields(body)
    stream = _flag(body, "stream", False)
    include_usage = _stream_options(body, stream)
    n = _int_field(body, "n", 1, low=1)
    want_logprobs = _flag(body, "logprobs", False)
    top = _int_field(body, "top_logprobs", 0, low=0)
    if top and not want_logprobs:
        raise ChatError("top_logprobs needs logprobs=true")
    _response_format(body)
    messages = _messages(body)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ChatError("tools must be a list of objects")
    choice = _tool_choice(body, tools)
    if choice == "none":
        tools = None
    prefix = ""
    if _flag(body, "continue_final_message", False) and messages[-1]["role"] == "assistant":
        prefix = str(messages.pop()["content"] or "")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ChatError(f"chat_template_kwargs must be an object, got {kwargs!r}")
    try:
        prompt = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja errors, bad message shapes
        raise ChatError(f"messages could not be rendered with the chat template: {exc}") from exc
    # A forced call starts the turn the way the template writes one; the model writes the rest.
    forced = lookahead = ""
    if choice == "required":
        first = ((tools or [{}])[0].get("function") or {}).get("name") or "f"
        forced, lookahead = OPEN + '\n{"name": "', f'{first}", "arguments": {{"'
    elif choice is not None and choice != "none":
        forced = OPEN + "\n" + json.dumps({"name": choice})[:-1] + ', "arguments": '
        lookahead = '{"'
    input_ids, forced = _aligned(prompt + prefix, forced, lookahead, encode, decode)
    rid = body.get("rid")
    if rid is not None and not (isinstance(rid, str) and rid):
        raise ChatError(f"rid must be a non-empty string, got {rid!r}")
    base = rid or new_rid()
    sampling = _sampling(body)
    requests = [
        GenerateRequest(
            rid=base if n == 1 else f"{base}_{i}",
            input_ids=tuple(input_ids),
            sampling=sampling,
            # A stream is cut per token, so it needs the token texts even without logprobs.
            return_logprob=want_logprobs or stream,
            top_logprobs_num=top,
            return_text_in_logprobs=want_logprobs or stream,
        )
        for i in range(n)
    ]
    created = int(time.time())
    head = {"id": f"chatcmpl-{base}", "created": created, "model": model_name}
    if (
        stream
        and n == 1
        and not tools
        and not sampling.stop
        and follow is not None
        and decode_text is not None
    ):
        live = dataclasses.replace(requests[0], stream=True)
        tokens = await follow(live)  # submitted now: a refused request is still a 400
        return ChatReply(
            events=_live_events(
                head, tokens, prefix=forced, prompt_tokens=len(input_ids),
                decode=decode, decode_text=lambda ids: decode_text(
                    ids, sampling.skip_special_tokens),
                want_logprobs=want_logprobs, include_usage=include_usage,
            )
        )  # fmt: skip
    outputs = await run(requests)
    choices = [
        _choice(i, out, forced, tools, f"call_{base}_{i}_", decode if want_logprobs else None)
        for i, out in enumerate(outputs)
    ]
    completion_tokens = sum(len(o.output_ids) for o in outputs)
    usage = {
        "prompt_tokens": len(input_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(input_ids) + completion_tokens,
    }
    if not stream:
        return ChatReply(
            body={**head, "object": "chat.completion", "choices": choices, "usage": usage}
        )
    return ChatReply(events=tuple(sse_events(head, choices, outputs, usage if include_usage
                                             else None)))  # fmt: skip


def _aligned(
    prompt: str,
    forced: str,
    lookahead: str,
    encode: Callable[[str], list[int]],
    decode: Callable[[Sequence[int]], str],
) -> tuple[list[int], str]:
    """Prompt ids ending with as much of ``forced`` as ends on a token boundary.

    Cut mid-token, a forced prefix tokenizes unlike the same text inside a whole call (BPE
    merges across the cut), and the model continues from ids it never saw. So the forced text
    is tokenized together with what usually follows it (``lookahead``) and cut back to the last
    token that ends within it; returns those ids and the forced text they carry.
    """
    if not forced:
        return encode(prompt), ""
    ids = encode(prompt + forced + lookahead)
    target = len(prompt) + len(forced)
    low, high = 0, len(ids)  # decode(ids[:low]) fits; find the longest prefix that does
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(ids[:mid])) <= target:
            low = mid
        else:
            high = mid - 1
    text = decode(ids[:low])
    if not text.startswith(prompt):  # the forced text merged into the prompt: force nothing
        return encode(prompt), ""
    return ids[:low], text[len(prompt) :]


def _choice(
    index: int,
    out: GenerateOutput,
    forced: str,
    tools: list[dict[str, Any]] | None,
    id_prefix: str,
    decode: Callable[[Sequence[int]], str] | None,
) -> dict[str, Any]:
    finish = out.meta_info["finish_reason"]
    kind = finish["type"]
    text = forced + out.text
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None}
    reason = kind
    if tools:
        content, calls = split_tool_calls(text, id_prefix=id_prefix)
        if calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "index": k,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for k, c in enumerate(calls)
            ]
            if kind == "stop":
                reason = "tool_calls"
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "logprobs": None,
        "finish_reason": reason,
        "matched_stop": finish.get("matched"),
    }
    if decode is not None:
        choice["logprobs"] = {"content": _logprobs(out, decode)}
    return choice


def _logprobs(out: GenerateOutput, decode: Callable[[Sequence[int]], str]) -> list[Any]:
    """SGLang's ``_build_token_logprobs_from_raw``: one entry per output token."""
    entries = out.meta_info.get("output_token_logprobs") or []
    tops = out.meta_info.get("output_top_logprobs") or []
    content = []
    for i, (logprob, token_id, text) in enumerate(entries):
        token = text if text is not None else decode([token_id])
        top = []
        for top_logprob, _top_id, top_text in tops[i] if i < len(tops) and tops[i] else []:
            top.append(
                {
                    "token": top_text or "",
                    "bytes": list((top_text or "").encode()),
                    "logprob": top_logprob,
                }
            )
        content.append(
            {"token": token, "bytes": list(token.encode()), "logprob": logprob, "top_logprobs": top}
        )
    return content


def _chunk(head: dict[str, Any], choices: list[dict[str, Any]], **extra: Any) -> str:
    body = {**head, "object": "chat.completion.chunk", "choices": choices, **extra}
    return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"


def sse_events(
    head: dict[str, Any],
    choices: list[dict[str, Any]],
    outputs: list[GenerateOutput],
    usage: dict[str, Any] | None,
) -> list[str]:
    """The ``text/event-stream`` body of a streamed completion (see the module docstring)."""
    events: list[str] = []

    def delta(index: int, d: dict[str, Any], logprobs: Any = None, **rest: Any) -> str:
        return _chunk(
            head,
            [{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": None, **rest}],
        )

    for choice, out in zip(choices, outputs, strict=True):
        i, message = choice["index"], choice["message"]
        events.append(delta(i, {"role": "assistant", "content": ""}))
        calls = message.get("tool_calls")
        if calls:
            if message["content"]:
                events.append(delta(i, {"content": message["content"]}))
            for call in calls:
                events.append(delta(i, {"tool_calls": [call]}))
        else:
            lp = (choice["logprobs"] or {}).get("content")
            tokens = [t or "" for _, _, t in out.meta_info.get("output_token_logprobs") or []]
            text = message["content"] or ""
            if tokens and "".join(tokens[:-1]) == text:  # the stop token is not in the text
                tokens = tokens[:-1]
            if "".join(tokens) != text:  # a trimmed stop string, a forced prefix: one piece
                tokens, lp = [text] if text else [], None
            for k, piece in enumerate(tokens):
                events.append(
                    delta(i, {"content": piece}, None if lp is None else {"content": [lp[k]]})
                )
        events.append(
            _chunk(
                head,
                [
                    {
                        "index": i,
                        "delta": {},
                        "logprobs": None,
                        "finish_reason": choice["finish_reason"],
                        "matched_stop": choice["matched_stop"],
                    }
                ],
            )
        )
    if usage is not None:
        events.append(_chunk(head, [], usage=usage))
    events.append("data: [DONE]\n\n")
    return events


def _token_logprob(event: TokenEvent, decode: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    token = decode([event.token_id])
    top = [
        {"token": decode([tid]), "bytes": list(decode([tid]).encode()), "logprob": lp}
        for lp, tid in event.top or ()
    ]
    return {"token": token, "bytes": list(token.encode()), "logprob": event.logprob,
            "top_logprobs": top}  # fmt: skip


async def _live_events(
    head: dict[str, Any],
    tokens: Follow,
    *,
    prefix: str,
    prompt_tokens: int,
    decode: Callable[[Sequence[int]], str],
    decode_text: Callable[[Sequence[int]], str],
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    """A plain single answer streamed as it is generated (see the module docstring)."""

    def delta(d: dict[str, Any], logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": None}
        return _chunk(head, [choice])

    yield delta({"role": "assistant", "content": ""})
    ids: list[int] = []
    unsent: list[dict[str, Any]] = []  # logprobs of tokens whose text is not out yet
    sent = ""
    output: GenerateOutput | None = None
    try:
        async for events, output in tokens:
            ids.extend(e.token_id for e in events)
            if want_logprobs:
                unsent.extend(_token_logprob(e, decode) for e in events)
            text = prefix + (output.text if output is not None else decode_text(ids))
            if output is None and text.endswith("\ufffd"):
                continue  # the last token ends inside a character
            if len(text) > len(sent) and text.startswith(sent):
                piece, sent = text[len(sent) :], text
                yield delta({"content": piece}, {"content": unsent} if want_logprobs else None)
                unsent = []
    finally:
        close = getattr(tokens, "aclose", None)
        if close is not None:
            await close()
    if output is None:  # the client went away: the request was aborted, nobody to tell
        return
    if unsent:  # e.g. the stop token, whose text is not part of the answer
        yield delta({"content": ""}, {"content": unsent})
    finish = output.meta_info["finish_reason"]
    choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish["type"],
              "matched_stop": finish.get("matched")}  # fmt: skip
    yield _chunk(head, [choice])
    if include_usage:
        completion = len(output.output_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                 "total_tokens": prompt_tokens + completion}  # fmt: skip
        yield _chunk(head, [], usage=usage)
    yield "data: [DONE]\n\n"
