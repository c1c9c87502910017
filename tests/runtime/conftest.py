"""The runtime tests run on every implementation of the log port."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["memory", "fakeredis", "redis-server"])
def log_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
