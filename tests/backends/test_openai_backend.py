"""``OpenAIBackend``: reply parsing against the documented chat-completion shape, and tinylm.

The reply shape is OpenAI's chat completion object (API reference "The chat completion object";
function-calling guide): ``choices[0].message.tool_calls[]`` with a mandatory ``id``,
``type: "function"`` and ``function.arguments`` as a JSON *string*; ``content`` is ``null`` on a
pure tool-call turn, whose ``finish_reason`` is ``"tool_calls"``. Some OpenAI-compatible stacks
send ``arguments`` as an object instead; that variant is accepted too.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.backends import (
    Capabilities,
    GenerationResult,
    ModelBackend,
    OpenAIBackend,
    OpenAIConfig,
    ToolCall,
    Usage,
    _http,
)
from engine.backends._http import StatusRetry, retry_after_s
from engine.backends.openai import to_chat_params
from engine.errors import BackendHTTPError, BackendProtocolError, ConfigError
from tests.backends.conftest import MATH_QUESTION
from tinylm.corpus import PYTHON_TOOL
from tinylm.server import TinyLMServer

TOOL_CALL_REPLY: dict[str, Any] = {
    "id": "chatcmpl-abc123",
    "object": "chat.completion",
    "created": 1699896916,
    "model": "gpt-4o-mini",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_abc123",
                        "type": "function",
                        "function": {
                            "name": "get_current_weather",
                            "arguments": '{\n"location": "Boston, MA"\n}',
                        },
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 82, "completion_tokens": 17, "total_tokens": 99},
}


def mock_backend(handler: Any, **config: Any) -> OpenAIBackend:
    return OpenAIBackend(
        config=OpenAIConfig(base_url="http://api.test/v1", model="m", **config),
        transport=httpx.MockTransport(handler),
    )


async def test_documented_tool_call_reply() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=TOOL_CALL_REPLY)

    backend = mock_backend(handler, api_key="sk-test")
    result = await backend.generate(
        messages=[{"role": "user", "content": "Weather in Boston?"}],
        tools=[{"type": "function", "function": {"name": "get_current_weather"}}],
        sampling_params={"max_new_tokens": 64, "temperature": 0.5, "sampling_seed": 3},
    )
    await backend.aclose()
    assert result == GenerationResult(
        text="",
        tool_calls=(
            ToolCall(
                name="get_current_weather",
                arguments='{\n"location": "Boston, MA"\n}',
                id="call_abc123",
            ),
        ),
        finish_reason="tool_calls",
        usage=Usage(prompt_tokens=82, completion_tokens=17),
    )
    assert result.tool_calls is not None
    assert result.tool_calls[0].parsed_arguments() == {"location": "Boston, MA"}
    request = seen[0]
    assert str(request.url) == "http://api.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-test"
    body = json.loads(request.content)
    assert body["model"] == "m" and body["max_completion_tokens"] == 64 and body["seed"] == 3
    assert "max_tokens" not in body
    assert (
        body["temperature"] == 0.5 and body["tools"][0]["function"]["name"] == "get_current_weather"
    )


async def test_object_arguments_and_plain_text_replies() -> None:
    reply = json.loads(json.dumps(TOOL_CALL_REPLY))
    call = reply["choices"][0]["message"]["tool_calls"][0]
    call["function"]["arguments"] = {"location": "Paris"}
    del call["id"]
    backend = mock_backend(lambda r: httpx.Response(200, json=reply))
    result = await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    assert result.tool_calls == (
        ToolCall(name="get_current_weather", arguments='{"location": "Paris"}', id="call_0"),
    )
    text_reply = {
        "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}]
    }
    backend = mock_backend(lambda r: httpx.Response(200, json=text_reply))
    result = await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    await backend.aclose()
    assert (result.text, result.tool_calls, result.finish_reason, result.usage) == (
        "hi",
        None,
        "length",
        None,
    )


@pytest.mark.parametrize(
    ("reply", "named"),
    [
        ({"choices": []}, "choices"),
        ({"choices": [{"message": "hi"}]}, "choices[0].message"),
        ({"choices": [{"message": {"content": 5}}]}, "message.content"),
        (
            {"choices": [{"message": {"content": "", "tool_calls": [{"function": {}}]}}]},
            "tool_calls[0]",
        ),
        ({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "1"}}, "usage"),
        ([1, 2], "<body>"),
    ],
)
async def test_malformed_replies_are_protocol_errors(reply: Any, named: str) -> None:
    backend = mock_backend(lambda r: httpx.Response(200, json=reply))
    with pytest.raises(BackendProtocolError, match=named.replace("[", r"\[").replace("]", r"\]")):
        await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    await backend.aclose()


async def test_error_status_and_unknown_finish_reason() -> None:
    backend = mock_backend(lambda r: httpx.Response(401, json={"error": {"message": "bad key"}}))
    with pytest.raises(BackendHTTPError, match="HTTP 401") as info:
        await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    assert info.value.url == "http://api.test/v1/chat/completions"
    filtered = {"choices": [{"message": {"content": ""}, "finish_reason": "content_filter"}]}
    backend = mock_backend(lambda r: httpx.Response(200, json=filtered))
    result = await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    await backend.aclose()
    assert result.finish_reason == "error:content_filter"


def test_sampling_params_translate_or_are_refused_by_name() -> None:
    assert to_chat_params(
        {
            "max_new_tokens": 5,
            "sampling_seed": 1,
            "top_p": 0.9,
            "stop": ["x"],
            "top_k": -1,
            "no_stop_trim": False,
        }
    ) == {"max_completion_tokens": 5, "seed": 1, "top_p": 0.9, "stop": ["x"]}
    assert to_chat_params({"max_new_tokens": 5}, max_tokens_field="max_tokens") == {
        "max_tokens": 5
    }
    with pytest.raises(ValueError, match="top_k=5 has no chat-completions equivalent"):
        to_chat_params({"top_k": 5})
    with pytest.raises(ValueError, match="unknown sampling parameter 'temprature'"):
        to_chat_params({"temprature": 1.0})


async def test_it_is_a_text_only_backend() -> None:
    backend = OpenAIBackend(config=OpenAIConfig(base_url="http://api.test/v1", model="m"))
    assert isinstance(backend, ModelBackend) and backend.capabilities == Capabilities()
    assert backend.base_url == "http://api.test/v1"
    with pytest.raises(NotImplementedError, match=r"OpenAIBackend\(http://api.test/v1\).*token_ids"):
        backend.tokenize("x")
    with pytest.raises(NotImplementedError, match="token_ids"):
        backend.decode([1])
    with pytest.raises(NotImplementedError, match="token_ids"):
        await backend.generate(input_ids=[1], sampling_params={})
    for operation, capability in (
        (backend.score([1], [2]), "scoring"),
        (backend.abort("rid"), "abort"),
        (backend.weight_version(), "weight_version"),
        (backend.health(), "health"),
    ):
        with pytest.raises(NotImplementedError, match=f"has no {capability} capability"):
            await operation
    assert "sk-secret" not in repr(
        OpenAIConfig(base_url="http://a/v1", model="m", api_key="sk-secret")
    )


# -- against tinylm ---------------------------------------------------------------------------


def tinylm_backend(server: TinyLMServer) -> OpenAIBackend:
    return OpenAIBackend(config=OpenAIConfig(base_url=server.url + "/v1", model="tinylm"))


async def test_plain_chat_against_tinylm(tinylm_server: TinyLMServer) -> None:
    backend = tinylm_backend(tinylm_server)
    messages = [{"role": "user", "content": "hello"}]
    params = {"max_new_tokens": 7, "temperature": 1.0, "sampling_seed": 4}
    first = await backend.generate(messages=messages, sampling_params=params)
    again = await backend.generate(messages=messages, sampling_params=params)
    await backend.aclose()
    assert first == again  # seeded
    assert first.token_ids is None and first.logprobs is None
    assert first.usage is not None and first.usage.prompt_tokens > 0
    assert first.usage.completion_tokens <= 7
    if first.finish_reason == "length":
        assert first.usage.completion_tokens == 7


async def test_tool_call_round_trip_against_tinylm(toolcall_server: TinyLMServer) -> None:
    backend = tinylm_backend(toolcall_server)
    messages: list[dict[str, Any]] = [{"role": "user", "content": MATH_QUESTION}]
    greedy = {"max_new_tokens": 64, "temperature": 0}
    call_turn = await backend.generate(
        messages=messages, tools=[PYTHON_TOOL], sampling_params=greedy
    )
    assert call_turn.finish_reason == "tool_calls" and call_turn.text == ""
    assert call_turn.tool_calls is not None and len(call_turn.tool_calls) == 1
    call = call_turn.tool_calls[0]
    assert call.name == "python" and call.parsed_arguments() == {"code": "print(17 + 25)"}
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    answer = await backend.generate(messages=messages, tools=[PYTHON_TOOL], sampling_params=greedy)
    await backend.aclose()
    assert answer.finish_reason == "stop" and answer.tool_calls is None
    assert answer.text == "The answer is <answer>42</answer>"


async def test_tinylm_refuses_what_it_cannot_do(tinylm_server: TinyLMServer) -> None:
    async with httpx.AsyncClient(base_url=tinylm_server.url) as client:
        bad = await client.post("/v1/chat/completions", json={"messages": [], "model": "m"})
        assert (
            bad.status_code == 400 and "messages must be a non-empty list" in bad.json()["message"]
        )
        # SGLang serves these; tinylm cannot, and says so by name instead of dropping them.
        refused = (("return_hidden_states", True), ("regex", "a+"), ("frequency_penalty", 1.0))
        for field, value in refused:
            bad = await client.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}], field: value},
            )
            assert bad.status_code == 400 and field in bad.json()["message"]
        bad = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "temprature": 0},
        )
        assert bad.status_code == 400 and "temprature" in bad.json()["message"]
        bad = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}
        )
        assert bad.status_code == 400 and "unknown role robot" in bad.json()["message"]


async def test_tool_choice_none_hides_the_tools(
    toolcall_server: TinyLMServer, toolcall_dir: Path
) -> None:
    async with httpx.AsyncClient(base_url=toolcall_server.url) as client:
        reply = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": MATH_QUESTION}],
                "tools": [PYTHON_TOOL],
                "tool_choice": "none",
                "max_tokens": 1,
                "temperature": 0,
            },
        )
    body = reply.json()
    assert reply.status_code == 200 and "tool_calls" not in body["choices"][0]["message"]
    # The prompt carried no tool list: far fewer tokens than with the tools' system block.
    assert body["usage"]["prompt_tokens"] < 40


# -- retries, newer fields ----------------------------------------------------------------------


class Replies:
    """A MockTransport handler answering a scripted sequence of responses."""

    def __init__(self, *responses: httpx.Response) -> None:
        self.responses = list(responses)
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        return self.responses.pop(0)


PLAIN = {"choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits the HTTP client asked for (not slept: the test checks them)."""
    asked: list[float] = []
    real_sleep = asyncio.sleep
    mine = threading.get_ident()

    async def record(delay: float, *args: Any, **kwargs: Any) -> Any:
        # ``_http.asyncio`` is the asyncio module: the patch reaches every thread's loop (a
        # uvicorn server another test left running ticks with asyncio.sleep), so only this
        # thread's calls are recorded and skipped.
        if threading.get_ident() != mine:
            return await real_sleep(delay, *args, **kwargs)
        asked.append(delay)
        return args[0] if args else kwargs.get("result")

    monkeypatch.setattr(_http.asyncio, "sleep", record)
    return asked


async def test_429_and_5xx_are_retried_honouring_retry_after(sleeps: list[float]) -> None:
    replies = Replies(
        httpx.Response(429, headers={"Retry-After": "7"}, json={"error": "slow down"}),
        httpx.Response(503, json={"error": "overloaded"}),
        httpx.Response(502, headers={"Retry-After": "3600"}, text="bad gateway"),
        httpx.Response(200, json=PLAIN),
    )
    backend = mock_backend(replies, status_retry=StatusRetry(retries=4, backoff_s=0.5, cap_s=30))
    result = await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    await backend.aclose()
    assert result.text == "ok" and replies.calls == 4
    # Retry-After wins; without it, backoff * 2**attempt; never past the cap.
    assert sleeps == [7.0, 1.0, 30.0]


async def test_retries_run_out_and_other_errors_are_not_retried(sleeps: list[float]) -> None:
    replies = Replies(*(httpx.Response(500, text="boom") for _ in range(3)))
    backend = mock_backend(replies, status_retry=StatusRetry(retries=2, backoff_s=0.0))
    with pytest.raises(BackendHTTPError, match="HTTP 500"):
        await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    assert replies.calls == 3
    for status in (400, 401, 404):
        once = Replies(httpx.Response(status, text="no"))
        b = mock_backend(once)
        with pytest.raises(BackendHTTPError, match=f"HTTP {status}"):
            await b.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
        assert once.calls == 1
    off = Replies(httpx.Response(429, text="slow"))
    b = mock_backend(off, status_retry=None)
    with pytest.raises(BackendHTTPError, match="HTTP 429"):
        await b.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    assert off.calls == 1


def test_retry_after_reads_seconds_and_http_dates() -> None:
    now = 1_700_000_000.0
    date = email.utils.formatdate(now + 12, usegmt=True)
    assert retry_after_s("3", now=now) == 3.0
    assert retry_after_s(date, now=now) == pytest.approx(12.0)
    assert retry_after_s("yesterday", now=now) is None and retry_after_s(None) is None
    assert StatusRetry(cap_s=5).delay_s(0, date, now=now) == 5.0
    assert StatusRetry(backoff_s=0.25).delay_s(3, None) == 2.0


async def test_refusal_and_reasoning_content_are_kept() -> None:
    reply = {
        "choices": [
            {
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": "I can't help with that.",
                    "reasoning_content": "The user asks for something unsafe.",
                },
                "finish_reason": "stop",
            }
        ]
    }
    backend = mock_backend(lambda r: httpx.Response(200, json=reply))
    result = await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})
    await backend.aclose()
    assert result.refusal == "I can't help with that."
    assert result.reasoning_content == "The user asks for something unsafe."
    bad = json.loads(json.dumps(reply))
    bad["choices"][0]["message"]["refusal"] = 3
    backend = mock_backend(lambda r: httpx.Response(200, json=bad))
    with pytest.raises(BackendProtocolError, match="message.refusal"):
        await backend.generate(messages=[{"role": "user", "content": "x"}], sampling_params={})


async def test_max_tokens_field_can_be_the_older_name() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=PLAIN)

    backend = mock_backend(handler, max_tokens_field="max_tokens")
    await backend.generate(
        messages=[{"role": "user", "content": "x"}], sampling_params={"max_new_tokens": 9}
    )
    await backend.aclose()
    assert seen[0]["max_tokens"] == 9 and "max_completion_tokens" not in seen[0]
    with pytest.raises(ConfigError, match="max_tokens_field"):
        OpenAIConfig(base_url="http://a/v1", model="m", max_tokens_field="max_length")  # type: ignore[arg-type]
