"""Real redis-server for the integration tests (see engine.ops.embedded).

It requires authentication like every Redis the engine starts: ``RedisServer.url`` is the
admin user's URL, password included; ``engine_url`` and ``trainer_url`` are the
least-privilege users (tests/security/test_redis_auth.py).
"""

from __future__ import annotations

import os

from engine.ops.embedded import EmbeddedRedis as RedisServer
from engine.ops.embedded import start_redis_server

__all__ = ["RedisServer", "redis_required", "start_redis_server"]


def redis_required() -> bool:
    """In CI a missing redis-server is a failure, not a skip."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
