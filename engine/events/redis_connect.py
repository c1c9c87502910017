"""The Redis client the log talks through, and the one place redis errors become ours.

:func:`connect` makes the socket timeout outlive the longest blocking read (redis-py would
time out and retry such a read forever) and disables blind retries, so a non-idempotent
XADD is never sent twice. A pooled connection idle for ``health_check_s`` is pinged first
and, when that PING finds it dead (Redis restarted), reconnected once: only the PING is
retried, and a consumer does not count a stale connection against its work.

A refused login is configuration, not an outage: :class:`~engine.errors.ConfigError`
naming the user and server, where transport errors raise
:class:`~engine.errors.LogUnavailable`, which callers ride out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.errors import ConfigError, LogError, LogUnavailable
from engine.events.redis_settings import RedisSettings

__all__ = ["RedisClient", "connect", "endpoint_of", "translate"]

RedisClient = aioredis.Redis | RedisCluster
"""What :func:`connect` builds: a client of one Redis, or of a Redis Cluster."""

_AUTH_ERRORS = (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)


def connect(settings: RedisSettings) -> RedisClient:
    """A client as the module docstring says. On a cluster, redirections (MOVED, ASK)
    are followed (the redirecting node did not run the command); the node pools do not
    reconnect on a failed PING, so a dead pooled connection costs one ``LogUnavailable``."""
    options: dict[str, Any] = dict(
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=False,
        max_connections=settings.max_connections,
        health_check_interval=settings.health_check_s,
    )
    if settings.username is not None:
        options["username"] = settings.username
    if settings.password is not None:
        options["password"] = settings.password
    if settings.tls:
        options.update(ssl_cert_reqs="required", ssl_check_hostname=False)
        if settings.tls_ca_file is not None:
            options["ssl_ca_certs"] = settings.tls_ca_file
        if settings.tls_cert_file is not None:
            options.update(ssl_certfile=settings.tls_cert_file, ssl_keyfile=settings.tls_key_file)
    if settings.is_cluster:
        return RedisCluster.from_url(settings.client_url, **options)
    client = aioredis.Redis.from_url(settings.url, retry_on_timeout=False, **options)
    pool = client.connection_pool
    pool.connection_class = _reconnecting(pool.connection_class)
    return client


_RECONNECTING: dict[type[Any], type[Any]] = {}


def _reconnecting(base: type[Any]) -> type[Any]:
    """``base`` (plain or TLS) whose health check reconnects once when its PING finds no
    connection. The reconnect's handshake runs the check too, so it does not nest; a PING
    refused for credentials is an error, not a dead connection."""
    cls = _RECONNECTING.get(base)
    if cls is None:

        async def check_health(self: Any) -> None:
            if not self.health_check_interval:
                return
            if asyncio.get_running_loop().time() <= self.next_health_check:
                return
            try:
                await self._send_ping()
            except _AUTH_ERRORS:
                raise
            except (rexc.ConnectionError, rexc.TimeoutError, OSError):
                if getattr(self, "_reconnecting", False):
                    raise
                self._reconnecting = True
                try:
                    await self.disconnect()
                    await self.connect()
                    await self._send_ping()
                finally:
                    self._reconnecting = False

        cls = _RECONNECTING[base] = type(
            f"Reconnecting{base.__name__}", (base,), {"check_health": check_health}
        )
    return cls


def endpoint_of(client: RedisClient) -> str:
    """Who the client connects as and where, for messages: ``user 'engine' at
    127.0.0.1:6379``."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
        where = ", ".join(client.nodes_manager.startup_nodes) or "the cluster"
    else:
        kwargs = client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port', 6379)}"
    return f"user {kwargs.get('username') or 'default'!r} at {where}"


def _auth_failure(exc: BaseException) -> BaseException | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _AUTH_ERRORS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def translate(what: str, endpoint: str) -> Iterator[None]:
    """Run a redis call, its exceptions raised as the engine's."""
    try:
        yield
    except rexc.RedisError as exc:
        refused = _auth_failure(exc)
        if refused is not None:
            raise ConfigError(
                f"Redis refused the login of {endpoint} ({refused}): check the credentials "
                f"(the URL's user:password, ROLLOUT_REDIS_USERNAME, "
                f"ROLLOUT_REDIS_PASSWORD_FILE)"
            ) from exc
        if isinstance(exc, rexc.ConnectionError | rexc.TimeoutError):
            raise LogUnavailable(f"redis unavailable during {what}: {exc}") from exc
        if isinstance(exc, rexc.ClusterError | rexc.SlotNotCoveredError):  # a node is down
            raise LogUnavailable(f"redis cluster unavailable during {what}: {exc}") from exc
        if isinstance(exc, rexc.RedisClusterException):  # e.g. keys of several slots
            raise LogError(f"redis cluster refused {what}: {exc}") from exc
        if isinstance(exc, rexc.ResponseError):
            raise LogError(f"redis refused {what}: {exc}") from exc
        if isinstance(exc, rexc.InvalidResponse):  # e.g. the URL points at an HTTP server
            raise LogError(
                f"{what}: the server does not speak the Redis protocol ({exc}); does the "
                f"Redis URL (--redis-url / ROLLOUT_REDIS_URL) point at a Redis server?"
            ) from exc
        raise
    except OSError as exc:
        raise LogUnavailable(f"redis unavailable during {what}: {exc}") from exc
    _reraise_swallowed_cancel()


def _reraise_swallowed_cancel() -> None:
    """Raise ``CancelledError`` if this task was cancelled but a redis call swallowed it:
    on Python 3.11 the ``asyncio.wait_for`` redis-py sends under returns normally when
    the cancellation lands as the send completes, and the task would run on past its stop
    (or a caller's timeout). Every log call ends here."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
