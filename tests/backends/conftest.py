"""Fixtures for the backend tests: servers for the tinylm models ``tests/conftest.py`` builds
once per session (shared with the proxy tests):

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

from tests.conftest import TINYLM_DIALOGUE as MATH_DIALOGUE
from tests.conftest import TINYLM_QUESTION as MATH_QUESTION
from tinylm.server import TinyLMServer, start_server

__all__ = ["MATH_DIALOGUE", "MATH_QUESTION"]  # the backend tests import them from here


@pytest.fixture(scope="package")  # servers stop when the backend tests end
def tinylm_server(tinylm_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(tinylm_dir, max_running_requests=8) as server:
        yield server


@pytest.fixture(scope="package")
def toolcall_server(toolcall_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(toolcall_dir, max_running_requests=4) as server:
        yield server
