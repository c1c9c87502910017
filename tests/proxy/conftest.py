"""Fixtures for the recording-proxy tests: real tinylm servers (``start_server``, free ports),
their tokenizers, and a ``BackendPool`` whose ``SGLangBackend`` the proxy generates through.

- ``random_server``: seeded random weights (0 training steps): gibberish text, but real HTTP,
  tokenization and logprobs; the guard cases use it.
- ``tool_server``: overfit on the backend tests' math dialogue, so greedy decoding reproduces a
  ``python`` tool call and then the answer: the tool-call path end to end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.backends.pool import BackendPool
from engine.backends.sglang import load_tokenizer
from tinylm.server import TinyLMServer, start_server


@pytest.fixture(scope="session")
def random_dir(tinylm_dir: Path) -> Path:
    return tinylm_dir  # tests/conftest.py: random weights, real tokenizer and template


@pytest.fixture(scope="session")
def tool_dir(toolcall_dir: Path) -> Path:
    return toolcall_dir  # tests/conftest.py: overfit on one math tool-call dialogue


@pytest.fixture(scope="package")  # servers stop when the proxy tests end
def random_server(random_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(random_dir, max_running_requests=4) as server:
        yield server


@pytest.fixture(scope="package")
def tool_server(tool_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tool_dir, max_running_requests=4) as server:
        yield server


@pytest.fixture(scope="session")
def random_tokenizer(random_dir: Path) -> Any:
    return load_tokenizer(random_dir)


@pytest.fixture(scope="session")
def tool_tokenizer(tool_dir: Path) -> Any:
    return load_tokenizer(tool_dir)


@pytest.fixture
async def random_pool(random_server: TinyLMServer) -> AsyncIterator[BackendPool]:
    async with BackendPool(random_server.url) as pool:
        yield pool


@pytest.fixture
async def tool_pool(tool_server: TinyLMServer) -> AsyncIterator[BackendPool]:
    async with BackendPool(tool_server.url) as pool:
        yield pool
