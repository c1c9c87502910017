"""Fixtures for the backend tests: tinylm models built once per session, and servers for them.

- ``tinylm_dir``: ``init_model`` with 0 training steps (seeded random weights, real tokenizer
  and chat template): outputs are gibberish but every byte of HTTP, tokenization and logprob
  plumbing is real.
- ``toolcall_dir``: a model overfit on one math dialogue, so greedy decoding reproduces that
  dialogue's tool call and answer; it pins the tool-call path end to end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.ops.tinylm import init_model
from tinylm.corpus import PYTHON_TOOL, Dialogue
from tinylm.model import TrainSettings
from tinylm.server import TinyLMServer, start_server

MATH_QUESTION = "What is 17 + 25?"
MATH_DIALOGUE = Dialogue(
    messages=[
        {"role": "user", "content": MATH_QUESTION},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "python", "arguments": {"code": "print(17 + 25)"}},
                }
            ],
        },
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "The answer is <answer>42</answer>"},
    ],
    tools=[PYTHON_TOOL],
)


@pytest.fixture(scope="session")
def tinylm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm") / "model"
    init_model(path, seed=0, train_steps=0)
    return path


@pytest.fixture(scope="session")
def toolcall_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tinylm-toolcall") / "model"
    init_model(
        path,
        seed=0,
        dialogues=[MATH_DIALOGUE],
        train=TrainSettings(steps=60, batch_size=2, learning_rate=5e-3, warmup_steps=5),
    )
    return path


@pytest.fixture(scope="session")
def tinylm_server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tinylm_dir, max_running_requests=8) as server:
        yield server


@pytest.fixture(scope="session")
def toolcall_server(toolcall_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(toolcall_dir, max_running_requests=4) as server:
        yield server
