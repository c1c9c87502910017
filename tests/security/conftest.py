"""Fixtures of the security suite: the control plane a worker has (an authenticated Redis, a
model server with an admin key), and sandboxes of both backends to attack it from.

Everything is real: a ``redis-server`` with ACL users, tinylm over sockets, sandboxes run by
the local supervisor or by dockerd.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.ops.embedded import EmbeddedRedis, start_redis_server
from engine.ops.tinylm import init_model
from tests.conftest import need_redis_server

# The sandbox suite's fixtures: a traversable sandbox root, the Docker test image.
from tests.sandbox.conftest import docker_image, local_provider, sandbox_root  # noqa: F401
from tinylm.server import TinyLMServer, start_server

ADMIN_KEY = "admin-" + secrets.token_hex(16)


@pytest.fixture(scope="session")
def secured_redis() -> Iterator[EmbeddedRedis]:
    need_redis_server()
    server = start_redis_server()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("security-tinylm") / "model"
    init_model(path, seed=0, train_steps=0)
    return path


@pytest.fixture(scope="package")
def model_server(model_dir: Path) -> Iterator[TinyLMServer]:
    """A model server whose admin routes only the holder of ``ADMIN_KEY`` may call."""
    with start_server(model_dir, max_running_requests=2, admin_api_key=ADMIN_KEY) as server:
        yield server
