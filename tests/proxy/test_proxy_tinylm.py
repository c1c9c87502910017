"""The recording proxy against real tinylm servers, driven by the real ``openai`` SDK.

What is pinned: the series the proxy generates on at every call is the tokenization of a full
re-render of the conversation (the native tool agent's series); tool calls come back as the
SDK's structured ``tool_calls``, streamed or not; the append-only guard (pure append keeps
capture on; a shrunk or rewritten history, or a server abort, turns it off and the call is
passed through to the server's own ``/v1/chat/completions``); capture off yields no token data.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from engine.backends.pool import BackendPool
from engine.outcomes import TerminationReason
from engine.proxy import RecordingProxy
from tests.backends.conftest import MATH_QUESTION
from tinylm.corpus import PYTHON_TOOL
from tinylm.server import TinyLMServer

pytestmark = pytest.mark.slow


def _client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _encode(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generated_runs(proxy: RecordingProxy) -> list[list[int]]:
    """The generated (mask 1) runs of the series, turn by turn."""
    rec = proxy.recorder
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(rec.response, rec.mask, strict=True):
        if bit == 1:
            if previous == 0:
                runs.append([])
            runs[-1].append(token)
        previous = bit
    return runs


def _raw(tokenizer: Any, ids: list[int]) -> str:
    special = set(tokenizer.all_special_ids)
    while ids and ids[-1] in special:
        ids = ids[:-1]
    return str(tokenizer.decode(ids, skip_special_tokens=False))


def _assert_rerender(
    proxy: RecordingProxy, tokenizer: Any, conversation: list[dict[str, Any]], tools: Any
) -> None:
    """At every call so far, the ids sent to /generate equal a full re-render of the
    conversation up to that call, each assistant turn written as the text the model generated."""
    rec = proxy.recorder
    series = rec.series()
    runs = _generated_runs(proxy)
    assistant_at = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    assert len(rec.turns) == len(assistant_at) + 1
    native = [dict(m) for m in conversation]
    for turn_ids, i in zip(runs, assistant_at, strict=False):
        native[i] = {"role": "assistant", "content": _raw(tokenizer, turn_ids)}
    for k, turn in enumerate(rec.turns):
        upto = assistant_at[k] if k < len(assistant_at) else len(native)
        expected = _encode(tokenizer, native[:upto], tools)
        assert series[: turn.prompt_tokens] == expected, f"call {k}"
    # and the whole series ends with the last generation, verbatim
    assert series[len(series) - len(runs[-1]) :] == runs[-1]


async def test_sdk_tool_episode_series_equals_native_rerender(
    tool_pool: BackendPool, tool_tokenizer: Any
) -> None:
    tools = [PYTHON_TOOL]
    async with RecordingProxy(backend=tool_pool.get(), tokenizer=tool_tokenizer) as proxy:
        client = _client(proxy.url)
        messages: list[dict[str, Any]] = [{"role": "user", "content": MATH_QUESTION}]
        first = await client.chat.completions.create(
            model="tinylm", messages=messages, tools=tools, temperature=0.0, max_tokens=64
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls is not None
        call = choice.message.tool_calls[0]
        assert call.function.name == "python"
        assert json.loads(call.function.arguments) == {"code": "print(17 + 25)"}
        assert (
            first.usage is not None
            and first.usage.prompt_tokens == proxy.recorder.turns[0].prompt_tokens
        )
        _assert_rerender(proxy, tool_tokenizer, messages, tools)

        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "42"},
        ]
        second = await client.chat.completions.create(
            model="tinylm", messages=messages, tools=tools, temperature=0.0, max_tokens=64
        )
        assert second.choices[0].message.content == "The answer is <answer>42</answer>"
        assert second.choices[0].finish_reason == "stop"
        _assert_rerender(proxy, tool_tokenizer, messages, tools)

    assert proxy.capture_valid and proxy.passed_through == 0
    traj = proxy.trajectory()
    assert traj is not None
    assert [t.tool_calls for t in traj.turns] == [("python",), ()]
    result = traj.agent_result(TerminationReason.FINISH)
    assert result.has_logprobs
    rec = proxy.recorder
    assert list(result.prompt_token_ids) == rec.prompt
    # observation tokens carry mask 0 and no logprob; generated ones their server logprob
    assert all(lp == 0.0 for lp, m in zip(rec.logprobs, rec.mask, strict=True) if m == 0)
    assert all(lp < 0.0 for lp, m in zip(rec.logprobs, rec.mask, strict=True) if m == 1)
    assert sum(rec.mask) == sum(t.response_tokens for t in traj.turns)


async def test_streamed_replies_carry_the_same_tool_calls_and_series(
    tool_pool: BackendPool, tool_tokenizer: Any
) -> None:
    tools = [PYTHON_TOOL]
    async with RecordingProxy(backend=tool_pool.get(), tokenizer=tool_tokenizer) as proxy:
        client = _client(proxy.url)
        messages: list[dict[str, Any]] = [{"role": "user", "content": MATH_QUESTION}]
        stream = await client.chat.completions.create(
            model="tinylm",
            messages=messages,
            tools=tools,
            temperature=0.0,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        )
        calls: dict[int, dict[str, str]] = {}
        finish = None
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or ():
                    slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += tc.id or ""
                    slot["name"] += (tc.function.name or "") if tc.function else ""
                    slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        assert finish == "tool_calls"
        assert (
            usage is not None and usage.completion_tokens == proxy.recorder.turns[0].response_tokens
        )
        assert [c["name"] for c in calls.values()] == ["python"]
        call = calls[0]
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": "python", "arguments": call["arguments"]},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "42"},
        ]
        stream = await client.chat.completions.create(
            model="tinylm", messages=messages, tools=tools, temperature=0.0, max_tokens=64,
            stream=True,
        )  # fmt: skip
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == "The answer is <answer>42</answer>"
        _assert_rerender(proxy, tool_tokenizer, messages, tools)
    assert proxy.trajectory() is not None


async def _turn(client: AsyncOpenAI, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    reply = await client.chat.completions.create(
        model="tinylm", messages=messages, max_tokens=kw.pop("max_tokens", 8), seed=3, **kw
    )
    assert reply.object == "chat.completion" and reply.choices
    return reply.choices[0].message.model_dump(exclude_none=True)


async def test_pure_append_keeps_capture_on(
    random_pool: BackendPool, random_tokenizer: Any
) -> None:
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        client = _client(proxy.url)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hello"},
        ]
        for i in range(3):
            messages += [await _turn(client, messages), {"role": "user", "content": f"more {i}"}]
        await _turn(client, messages)
    assert proxy.capture_valid and proxy.passed_through == 0 and proxy.calls == 4
    traj = proxy.trajectory()
    assert traj is not None and len(traj.turns) == 4
    assert len(traj.response_token_ids) == len(traj.loss_mask) == len(traj.response_logprobs)
    # each call generated on everything before it
    series = [*traj.prompt_token_ids, *traj.response_token_ids]
    ends = [t.prompt_tokens + t.response_tokens for t in traj.turns]
    assert all(a < b for a, b in zip(ends, [t.prompt_tokens for t in traj.turns[1:]], strict=False))
    assert ends[-1] == len(series)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda m: m[:1], "shrank"),
        (
            lambda m: [{"role": "user", "content": "summary of the task"}, *m[1:]],
            "rewritten at message 0",
        ),
        (lambda m: [*m[:2], {"role": "user", "content": "not your reply"}, *m[2:]], "rewritten"),
    ],
    ids=["shrink", "rewrite-summary", "rewrite-insert"],
)
async def test_a_non_append_history_turns_capture_off_and_passes_through(
    random_pool: BackendPool,
    random_tokenizer: Any,
    random_server: TinyLMServer,
    change: Any,
    reason: str,
) -> None:
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        client = _client(proxy.url)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        messages += [await _turn(client, messages), {"role": "user", "content": "again"}]
        await _turn(client, messages)
        assert proxy.capture_valid and proxy.passed_through == 0
        recorded = list(proxy.recorder.series())

        reply = await _turn(client, change(messages))  # answered by the server's own chat route
        assert not proxy.capture_valid
        assert reason in (proxy.invalid_reason or "")
        assert proxy.passed_through == 1 and reply["role"] == "assistant"
        # capture stays off: a later well-formed append is passed through too, streamed as the
        # server streams it
        stream = await client.chat.completions.create(
            model="tinylm",
            messages=[*messages, reply, {"role": "user", "content": "go on"}],
            max_tokens=8,
            stream=True,
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        assert proxy.passed_through == 2
        assert proxy.recorder.series() == recorded  # nothing was appended after the guard fired
    assert proxy.trajectory() is None


async def test_a_server_abort_turns_capture_off_and_the_call_still_completes(
    random_pool: BackendPool, random_tokenizer: Any
) -> None:
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        client = _client(proxy.url)
        call = asyncio.create_task(
            _turn(
                client,
                [{"role": "user", "content": "write a lot"}],
                max_tokens=1500,
                extra_body={"ignore_eos": True},
            )
        )
        # Abort the proxy's generation until the proxy has seen the abort (it then passes the
        # call through to the server's chat route, which no abort here reaches).
        while proxy.capture_valid and not call.done():
            await proxy.abort()
            await asyncio.sleep(0.02)
        reply = await call
    assert reply["role"] == "assistant"
    assert not proxy.capture_valid and "aborted" in (proxy.invalid_reason or "")
    assert proxy.passed_through == 1
    assert proxy.trajectory() is None


async def test_capture_on_and_off_answer_the_same_shape(
    random_pool: BackendPool, random_tokenizer: Any, random_server: TinyLMServer
) -> None:
    """A scaffold pointed at the proxy (capture on) or at the server (capture off, as in eval)
    gets the same ChatCompletion shape, and /v1/models is the server's."""
    messages = [{"role": "user", "content": "hello"}]
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        captured = await _client(proxy.url).chat.completions.create(
            model="tinylm", messages=messages, max_tokens=8, seed=1
        )
        proxied_models = await _client(proxy.url).models.list()
        assert proxy.trajectory() is not None
    direct = await _client(random_server.url).chat.completions.create(
        model="tinylm", messages=messages, max_tokens=8, seed=1
    )
    direct_models = await _client(random_server.url).models.list()
    assert [m.id for m in proxied_models.data] == [m.id for m in direct_models.data]

    def shape(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: shape(v) for k, v in obj.items() if v is not None}
        if isinstance(obj, list):
            return [shape(v) for v in obj[:1]]
        return type(obj).__name__

    skip = {"matched_stop", "system_fingerprint", "metadata"}
    a = {k: v for k, v in captured.model_dump().items() if k not in skip}
    b = {k: v for k, v in direct.model_dump().items() if k not in skip}
    for d in (a, b):
        for c in d["choices"]:
            for k in skip:
                c.pop(k, None)
    assert shape(a) == shape(b)
    # capture off: the proxy's result carries no token data
    assert captured.usage is not None and direct.usage is not None


async def test_the_port_is_released_at_teardown(
    random_pool: BackendPool, random_tokenizer: Any
) -> None:
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        url = proxy.url
        async with httpx.AsyncClient() as http:
            assert (await http.get(url + "/v1/models")).status_code == 200
    async with httpx.AsyncClient() as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(url + "/v1/models")


async def test_an_unexpected_error_passes_the_call_through(
    random_pool: BackendPool, random_tokenizer: Any, random_server: TinyLMServer
) -> None:
    """/generate refuses the request (HTTP 400): capture goes off and the scaffold gets the
    server's own answer to the same request, exactly as if it had called the server."""
    from openai import BadRequestError

    bad = {"min_p": 7.5}
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(BadRequestError) as direct:
        await _client(random_server.url).chat.completions.create(
            model="tinylm", messages=messages, max_tokens=8, extra_body=bad
        )
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        with pytest.raises(BadRequestError) as proxied:
            await _client(proxy.url).chat.completions.create(
                model="tinylm", messages=messages, max_tokens=8, extra_body=bad
            )
    assert proxied.value.status_code == direct.value.status_code == 400
    assert proxied.value.body == direct.value.body
    assert not proxy.capture_valid and "capture failed" in (proxy.invalid_reason or "")
    assert proxy.passed_through == 1 and proxy.trajectory() is None


async def test_the_proxy_needs_a_token_level_backend(random_tokenizer: Any) -> None:
    from engine.backends.openai import OpenAIBackend, OpenAIConfig
    from engine.errors import ConfigError

    backend = OpenAIBackend(config=OpenAIConfig(base_url="http://127.0.0.1:9/v1", model="m"))
    with pytest.raises(ConfigError, match="token_ids capability"):
        RecordingProxy(backend=backend, tokenizer=random_tokenizer)
