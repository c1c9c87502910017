"""The policy's generations stream (``SGLangConfig.stall_s``): the last chunk of SGLang's
streamed ``/generate`` is the very reply the plain request gets, read off the real tinylm
server; a stream that goes silent is a stall only once the server also fails its health
check, and then the call ends as ``ServerStalled``; a stream cut off is a connection failure.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from engine.backends import SGLangBackend, SGLangConfig
from engine.errors import BackendHTTPError, BackendUnavailable, ServerStalled
from tinylm.server import TinyLMServer

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]


class Counting(httpx.AsyncBaseTransport):
    """A real transport that keeps each request's body and reply content type."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.seen: list[tuple[dict[str, Any], str]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        if request.url.path == "/generate":
            body = json.loads(request.content)
            self.seen.append((body, response.headers.get("content-type", "")))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": 12, "temperature": 0.0},
        {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True},
        {"max_new_tokens": 5, "temperature": 0.7, "sampling_seed": 3, "stop_token_ids": [90]},
    ],
)
async def test_the_last_chunk_gives_exactly_the_plain_reply(
    tinylm_server: TinyLMServer, params: dict[str, Any]
) -> None:
    transport = Counting()
    streamed = SGLangBackend(
        config=SGLangConfig(url=tinylm_server.url, stall_s=10.0), transport=transport
    )
    plain = SGLangBackend(config=SGLangConfig(url=tinylm_server.url))
    try:
        a = await streamed.generate(input_ids=PROMPT, sampling_params=params, rid="s/a1/t0")
        b = await plain.generate(input_ids=PROMPT, sampling_params=params)
    finally:
        await streamed.aclose()
        await plain.aclose()
    assert a.token_ids and a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # float32 values, bit for bit
    assert (a.finish_reason, a.weight_version, a.usage, a.text) == (
        b.finish_reason,
        b.weight_version,
        b.usage,
        b.text,
    )
    ((body, content_type),) = transport.seen
    assert body["stream"] is True and content_type.startswith("text/event-stream")
    assert body["rid"] == "s/a1/t0" and body["sampling_params"]["stream_interval"] >= 1


def _events(*chunks: dict[str, Any]) -> list[bytes]:
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks]


FINAL = {"text": "hi", "output_ids": [5, 6], "meta_info": {
    "id": "r", "prompt_tokens": 3, "completion_tokens": 2, "weight_version": "4",
    "finish_reason": {"type": "length", "length": 2},
    "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
    "input_token_logprobs": [[None, 1, None]]}}  # fmt: skip
PARTIAL = {**FINAL, "output_ids": [5], "meta_info": {**FINAL["meta_info"], "finish_reason": None}}


class Scripted:
    """A server whose stream sends ``before``, then waits for ``resume`` (forever if it is
    never set), then sends ``after``; its health check answers ``health``."""

    def __init__(self, before: list[bytes], after: list[bytes], health: int = 503) -> None:
        self.before = before
        self.after = after
        self.health = health
        self.resume = asyncio.Event()
        self.health_checks = 0
        self.health_delay_s = 0.0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health_generate":
            self.health_checks += 1
            await asyncio.sleep(self.health_delay_s)
            return httpx.Response(self.health)

        async def body() -> AsyncIterator[bytes]:
            for chunk in self.before:
                yield chunk
            await self.resume.wait()
            for chunk in self.after:
                yield chunk

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())


def scripted_backend(server: Scripted, stall_s: float) -> SGLangBackend:
    config = SGLangConfig(url="http://policy.test:30000", stall_s=stall_s, health_timeout_s=1.0)
    return SGLangBackend(config=config, transport=httpx.MockTransport(server))


async def test_a_silent_stream_whose_server_fails_its_health_check_is_a_stall() -> None:
    server = Scripted(_events(PARTIAL), [])
    backend = scripted_backend(server, stall_s=0.2)
    started = time.monotonic()
    with pytest.raises(ServerStalled, match=r"no event for 0.2 s .* health check"):
        await backend.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert server.health_checks == 1 and time.monotonic() - started < 5
    await backend.aclose()


async def test_a_server_that_stops_before_its_headers_stalls_the_call_too() -> None:
    """A stopped process still accepts connections (the kernel's backlog): the call then
    waits for headers that never come, and that wait is watched like the stream's."""

    class Headless(Scripted):
        async def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.url.path == "/generate":
                await asyncio.Event().wait()  # never answers
            return await super().__call__(request)

    server = Headless([], [])
    backend = scripted_backend(server, stall_s=0.2)
    with pytest.raises(ServerStalled, match=r"no event for 0.2 s"):
        await backend.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    assert server.health_checks == 1
    await backend.aclose()


async def test_silent_streams_of_one_server_share_one_health_check() -> None:
    server = Scripted(_events(PARTIAL), [])
    server.health_delay_s = 0.5  # every stream falls silent while the one check runs
    backend = scripted_backend(server, stall_s=0.2)
    params = {"max_new_tokens": 2}
    calls = [backend.generate(input_ids=[1, 2, i], sampling_params=params) for i in range(8)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ServerStalled) for r in results), results
    assert server.health_checks == 1
    await backend.aclose()


async def test_a_silent_stream_of_a_healthy_server_waits_on_and_completes() -> None:
    server = Scripted(_events(PARTIAL), [*_events(FINAL), b"data: [DONE]\n\n"], health=200)
    backend = scripted_backend(server, stall_s=0.05)

    async def resume_after_checks() -> None:
        while server.health_checks < 2:  # silent twice, healthy twice: it waits on
            await asyncio.sleep(0.01)
        server.resume.set()

    resumer = asyncio.create_task(resume_after_checks())
    result = await backend.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    await resumer
    assert result.token_ids == (5, 6) and result.logprobs == (-0.5, -0.25)
    assert result.finish_reason == "length" and result.weight_version == 4
    await backend.aclose()


async def test_a_stream_cut_off_is_a_connection_failure_and_an_error_event_an_http_error() -> None:
    cut = Scripted(_events(PARTIAL), [])
    cut.resume.set()  # the body ends after the partial chunk: no final reply, no [DONE]
    backend = scripted_backend(cut, stall_s=5.0)
    with pytest.raises(BackendUnavailable, match=r"ended before its last event"):
        await backend.generate(input_ids=[1], sampling_params={"max_new_tokens": 2})
    error = {"error": {"message": "prompt too long", "code": 400,
                       "type": "invalid_request_error"}}  # fmt: skip
    refused = Scripted([], [*_events(error), b"data: [DONE]\n\n"])
    refused.resume.set()
    backend = scripted_backend(refused, stall_s=5.0)
    with pytest.raises(BackendHTTPError, match="prompt too long") as err:
        await backend.generate(input_ids=[1], sampling_params={"max_new_tokens": 2})
    assert err.value.status == 400 and not isinstance(err.value, BackendUnavailable)
