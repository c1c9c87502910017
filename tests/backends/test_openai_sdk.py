"""tinylm's ``/v1/chat/completions`` driven by the real ``openai`` SDK (the ``sdk`` extra).

What SGLang 0.5.23 serves (``python/sglang/srt/entrypoints/openai/protocol.py``,
``ChatCompletionRequest``; ``serving_chat.py``, ``_build_chat_response`` and
``_generate_chat_stream``) is what the tiny server must serve: a client written against SGLang
works against tinylm unchanged. The SDK parses every reply into its own typed models, so a
shape it does not accept fails here.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest

from tests.backends.conftest import MATH_QUESTION
from tests.backends.test_tinylm_server import wait_until
from tinylm.corpus import PYTHON_TOOL
from tinylm.server import TinyLMServer

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "What is 2 + 2?"}]

# The fields sglang-router 0.3.2 adds to every chat request it forwards (captured from the
# router's own requests); SGLang's ChatCompletionRequest declares each of them.
ROUTER_FIELDS: dict[str, Any] = {
    "logprobs": False,
    "stream": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}


def client(server: TinyLMServer) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_stream_sends_sglangs_chunks(tinylm_server: TinyLMServer) -> None:
    chunks = list(
        client(tinylm_server).chat.completions.create(
            model="tinylm",
            messages=USER,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    plain = client(tinylm_server).chat.completions.create(
        model="tinylm", messages=USER, max_tokens=6, temperature=0
    )
    first, *middle, last_choice, usage = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == first.id for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in middle)
    assert streamed == plain.choices[0].message.content
    assert last_choice.choices[0].finish_reason == plain.choices[0].finish_reason
    assert last_choice.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]


def test_logprobs_top_logprobs_and_n(tinylm_server: TinyLMServer) -> None:
    reply = client(tinylm_server).chat.completions.create(
        model="tinylm",
        messages=USER,
        max_tokens=5,
        temperature=1.0,
        seed=7,
        n=3,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for choice in reply.choices:
        assert choice.logprobs is not None and choice.logprobs.content
        for entry in choice.logprobs.content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.bytes == list(entry.token.encode())
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)  # type: ignore[union-attr]


def test_streamed_logprobs_come_per_token(tinylm_server: TinyLMServer) -> None:
    chunks = list(
        client(tinylm_server).chat.completions.create(
            model="tinylm",
            messages=USER,
            max_tokens=4,
            temperature=0,
            stream=True,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    )
    with_logprobs = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
    entries = [e for c in with_logprobs for e in c.choices[0].logprobs.content or []]  # type: ignore[union-attr]
    assert len(entries) == 4 and all(e.logprob <= 0 for e in entries)
    # Each piece of text comes with the logprobs of the tokens that wrote it.
    for chunk in with_logprobs:
        tokens = "".join(e.token for e in chunk.choices[0].logprobs.content or [])  # type: ignore[union-attr]
        assert chunk.choices[0].delta.content in (tokens, "") or "\ufffd" in tokens


def test_developer_role_and_content_parts(tinylm_server: TinyLMServer) -> None:
    c = client(tinylm_server)
    greedy: dict[str, Any] = {"model": "tinylm", "max_tokens": 4, "temperature": 0}
    as_parts = c.chat.completions.create(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"},
                                         {"type": "text", "text": "2 + 2?"}]},
        ],
        **greedy,
    )  # fmt: skip
    as_text = c.chat.completions.create(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
        ],
        **greedy,
    )
    # developer is the system prompt; text parts are joined with a space, as SGLang does.
    assert as_parts.usage == as_text.usage
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="text-only"):
        c.chat.completions.create(
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            **greedy,
        )  # fmt: skip


def test_response_format_is_accepted_as_sglang_accepts_it(tinylm_server: TinyLMServer) -> None:
    c = client(tinylm_server)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    for fmt in (
        {"type": "text"},
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    ):
        reply = c.chat.completions.create(
            model="tinylm", messages=USER, max_tokens=2, response_format=fmt  # type: ignore[arg-type]
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        c.chat.completions.create(
            model="tinylm",
            messages=USER,
            max_tokens=2,
            response_format={"type": "json_schema", "json_schema": {"schema": schema}},  # type: ignore[typeddict-item]
        )


def test_models_list_and_retrieve(tinylm_server: TinyLMServer) -> None:
    c = client(tinylm_server)
    [model] = c.models.list().data
    assert c.models.retrieve(model.id).id == model.id == tinylm_server.model_name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


def test_the_fields_sglang_router_adds_are_accepted(tinylm_server: TinyLMServer) -> None:
    reply = httpx.post(
        tinylm_server.url + "/v1/chat/completions",
        json={"model": "tinylm", "messages": USER, "max_completion_tokens": 3, **ROUTER_FIELDS},
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"


def test_continue_final_message_continues_the_assistant_turn(
    tinylm_server: TinyLMServer,
) -> None:
    c = client(tinylm_server)
    prefix = [*USER, {"role": "assistant", "content": "The answer"}]
    greedy: dict[str, Any] = {"model": "tinylm", "max_tokens": 3, "temperature": 0}
    continued = c.chat.completions.create(
        messages=prefix, extra_body={"continue_final_message": True}, **greedy
    )
    fresh = c.chat.completions.create(messages=USER, **greedy)
    assert continued.usage is not None and fresh.usage is not None
    # The prompt is the fresh one plus the assistant's words so far.
    assert continued.usage.prompt_tokens > fresh.usage.prompt_tokens


def test_tool_choice_required_and_named_start_a_call(toolcall_server: TinyLMServer) -> None:
    c = client(toolcall_server)
    messages = [{"role": "user", "content": MATH_QUESTION}]
    for choice in ("required", {"type": "function", "function": {"name": "python"}}):
        reply = c.chat.completions.create(
            model="tinylm",
            messages=messages,  # type: ignore[arg-type]
            tools=[PYTHON_TOOL],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=64,
            temperature=0,
        )
        [call] = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "python"
        assert json.loads(call.function.arguments) == {"code": "print(17 + 25)"}
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        c.chat.completions.create(
            model="tinylm",
            messages=messages,  # type: ignore[arg-type]
            tools=[PYTHON_TOOL],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "shell"}},
        )


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(toolcall_server: TinyLMServer) -> None:
    chunks = list(
        client(toolcall_server).chat.completions.create(
            model="tinylm",
            messages=[{"role": "user", "content": MATH_QUESTION}],
            tools=[PYTHON_TOOL],  # type: ignore[list-item]
            max_tokens=64,
            temperature=0,
            stream=True,
        )
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "python")]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_named_tool_choice_forces_the_call_even_on_an_untrained_model(
    tinylm_server: TinyLMServer,
) -> None:
    reply = client(tinylm_server).chat.completions.create(
        model="tinylm",
        messages=USER,  # type: ignore[arg-type]
        tools=[PYTHON_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "python"}},
        max_tokens=8,
        temperature=0,
    )
    message = reply.choices[0].message
    # Random weights cannot finish the call, so it comes back as text, begun as forced.
    calls = message.tool_calls or []
    assert [c.function.name for c in calls] == ["python"] or (message.content or "").startswith(
        '<tool_call>\n{"name": "python"'
    )


def test_a_plain_stream_is_sent_while_it_is_generated(tinylm_server: TinyLMServer) -> None:
    """Chunks leave before generation ends: the forward is held after a few steps, and the
    first content still arrives; closing the stream then aborts the request."""
    runtime = tinylm_server.scheduler._runtime
    forward, calls, release = runtime.forward, [0], threading.Event()

    def held(chunks: Any) -> Any:
        calls[0] += 1
        if calls[0] > 4:
            release.wait(60)
        return forward(chunks)

    body = {
        "model": "tinylm",
        "messages": USER,
        "max_tokens": 100_000,  # the whole context: thousands of steps if nobody stops it
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "rid": "live-stream",
    }
    runtime.forward = held  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=tinylm_server.url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.headers["content-type"].startswith("text/event-stream")
                lines = reply.iter_lines()
                content = ""
                for line in lines:
                    if not line.startswith("data: {"):
                        continue
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    content += delta.get("content") or ""
                    if content:
                        break
                # Held inside its forward, the request cannot have finished.
                assert content and "live-stream" in tinylm_server.scheduler.running_rids()
        steps = tinylm_server.scheduler.steps
    finally:
        runtime.forward = forward  # type: ignore[method-assign]
        release.set()
    wait_until(
        lambda: "live-stream" not in tinylm_server.scheduler.running_rids(),
        "the abort of the abandoned stream",
    )
    # Aborted within a few tokens of the client leaving, far from the end of the context.
    assert tinylm_server.scheduler.steps - steps < tinylm_server.scheduler.max_context // 2
