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
from engine.ops.tinylm import init_model
from tests.backends.conftest import MATH_DIALOGUE
from tinylm.model import TrainSettings
from tinylm.server import TinyLMServer, start_server


@pytest.fixture(scope="session")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("proxy-tinylm") / "model"
    init_model(path, seed=0, train_steps=0)
    return path


@pytest.fixture(scope="session")
def tool_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("proxy-toolcall") / "model"
    init_model(
        path,
        seed=0,
        dialogues=[MATH_DIALOGUE],
        train=TrainSettings(steps=60, batch_size=2, learning_rate=5e-3, warmup_steps=5),
    )
    return path


@pytest.fixture(scope="session")
def random_server(random_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(random_dir, max_running_requests=4) as server:
        yield server


@pytest.fixture(scope="session")
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
