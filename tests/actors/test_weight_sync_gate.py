"""The weight sync's gate on the paths an agent generates through: the backend pool's
``SGLangBackend`` and the recording proxy (its captured calls and its pass-through), against
a real tinylm server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from engine.backends.pool import BackendPool
from engine.proxy import RecordingProxy
from tests.proxy.conftest import random_dir, random_pool, random_tokenizer  # noqa: F401
from tinylm.server import TinyLMServer, start_server

PROMPT = [1, 310, 201, 40, 41, 42, 43, 2, 201, 1, 90]



@pytest.fixture(scope="module")
def random_server(random_dir: Path) -> Iterator[TinyLMServer]:  # noqa: F811
    """The proxy tests' server, for this module only: an imported package-scoped fixture
    would outlive the module and run to the end of the session."""
    with start_server(random_dir, max_running_requests=4) as server:
        yield server


def forward_steps(server: TinyLMServer) -> int:
    return int(httpx.get(server.url + "/get_server_info", timeout=30).json()["forward_steps"])


async def settle() -> None:
    for _ in range(20):  # let the waiting calls run as far as they can
        await asyncio.sleep(0.01)


async def test_a_closed_gate_holds_pool_generations_until_it_opens(
    random_pool: BackendPool, random_server: TinyLMServer  # noqa: F811
) -> None:
    gate = random_pool.gate
    view = random_pool.bind("trajectory-1")
    assert view.gate is gate
    gate.close("sync")
    before = forward_steps(random_server)
    call = asyncio.create_task(view.get().generate(
        input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "temperature": 0.0}))
    await settle()
    assert not call.done() and forward_steps(random_server) == before and gate.in_flight == 0
    gate.open()
    result = await asyncio.wait_for(call, 60)
    assert len(result.token_ids or ()) == 4 and forward_steps(random_server) > before


async def test_the_recording_proxy_passes_the_gate_captured_and_passed_through(
    random_pool: BackendPool, random_server: TinyLMServer, random_tokenizer: Any  # noqa: F811
) -> None:
    gate = random_pool.gate
    async with RecordingProxy(backend=random_pool.get(), tokenizer=random_tokenizer) as proxy:
        client = AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        for extra in ({}, {"n": 2}):  # n=2 cannot be captured: it passes through
            gate.close("sync")
            before = forward_steps(random_server)
            call = asyncio.create_task(client.chat.completions.create(
                model="tinylm", messages=messages, max_tokens=4, temperature=0.0, **extra))
            await settle()
            assert not call.done() and forward_steps(random_server) == before
            gate.open()
            reply = await asyncio.wait_for(call, 60)
            assert len(reply.choices) == (extra.get("n") or 1)
        assert proxy.passed_through == 1
