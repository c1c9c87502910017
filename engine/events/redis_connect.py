"""The Redis client the log talks through, and the one place redis errors become ours.

redis-py pitfall: a blocking read longer than ``socket_timeout`` times out at the socket and
is retried by the client forever. :func:`connect` therefore derives the socket timeout from
the longest block time and disables blind retries, so a non-idempotent XADD is never
silently sent twice.

A pooled connection left over from before a Redis restart is dead. Without a check the next
command sent on it fails (once per connection), and a consumer would count that transport
error against the work it was doing. :func:`connect` therefore pings a connection that has
been idle for ``health_check_s`` before using it and, when the ping fails for want of a
connection, reconnects once and pings again: only the PING is retried, never the command,
so nothing is sent twice. A PING refused for want of credentials is not retried.

Credentials are configuration, not an outage: a refused login (no password, a wrong one, an
unknown user) raises :class:`~engine.errors.ConfigError` naming the user and the server at
once, where a transport error raises :class:`~engine.errors.LogUnavailable`, which callers
ride out.
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
    """A client whose socket timeout outlives every BLOCK, that never retries a command
    blindly, and that replaces a dead pooled connection before using it (module doc).

    On a cluster, redirections (MOVED, ASK) are followed, which is safe (the node that
    answers with one did not run the command); a connection error is not retried: it
    surfaces as ``LogUnavailable`` and the caller's backoff rides it out, as on one Redis.
    The reconnect-on-failed-ping of a single Redis's pool is not installed on a cluster's
    node pools: there a dead pooled connection costs one ``LogUnavailable`` (retried).
    """
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
    """``base`` (plain or TLS, whichever the URL chose) whose health check reconnects once
    when its PING fails for want of a connection: a PING is idempotent, the command after it
    is sent only once. The reconnect's own handshake runs its health check too, so the
    check does not reconnect again while one is under way (each nested attempt would start
    another), and a PING the server refuses for want of credentials is an error, not a
    dead connection."""
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
    127.0.0.1:6379`` (the URL's user when it names one, else the settings', else
    ``default``)."""
    if isinstance(client, RedisCluster):
        kwargs = client.nodes_manager.connection_kwargs
        where = ", ".join(client.nodes_manager.startup_nodes) or "the cluster"
    else:
        kwargs = client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port', 6379)}"
    return f"user {kwargs.get('username') or 'default'!r} at {where}"


def _auth_failure(exc: BaseException) -> BaseException | None:
    """The login refusal behind ``exc`` (itself or a cause), if there is one."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _AUTH_ERRORS):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def translate(what: str, endpoint: str) -> Iterator[None]:
    """Run a redis call, its exceptions raised as the engine's (module doc)."""
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
    """Raise ``CancelledError`` if this task was cancelled but a redis call swallowed it.

    redis-py sends every command under ``asyncio.wait_for`` (the socket timeout), and on
    Python 3.11 ``wait_for`` returns normally when the cancellation lands just as the
    send completes (fixed in 3.12). The task then runs on with the cancellation request
    still counted (``Task.cancelling()``): a reader looping over the log would run on after
    its stop, and a trainer's ``wait_for(wait_ready(...))`` would outlive its timeout.
    Every log call ends here, so a swallowed cancellation takes effect as soon as the call
    it hit returns.
    """
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running loop
        return
    if task is not None and task.cancelling():
        raise asyncio.CancelledError()
