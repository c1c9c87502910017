"""The HTTP edge shared by the model backends: one pooled client, JSON in and out, our errors.

``JSONClient`` owns one ``httpx.AsyncClient`` (created lazily inside the running event loop, so
constructing a backend needs no loop; closed by ``aclose``). Every httpx failure is translated
here, naming the URL:

- could not connect (``ConnectError``, ``ConnectTimeout``): retried ``connect_retries`` times
  with exponential backoff, because the request never left this process; then
  ``BackendUnavailable``;
- anything after the request may have been sent (read timeout, reset, server gone) is **not**
  retried (a ``/generate`` POST the server already ran would run twice) and raises
  ``BackendUnavailable``;
- a reply that is not valid HTTP or whose body is not JSON: ``BackendProtocolError``; one cut
  short (the server closed the connection first) is ``ReplyCutOff``, also a
  ``BackendUnavailable`` (a lost connection, retried upstream);
- a server-sent event stream (``post_events``, SGLang's streamed ``/generate``): any bytes
  are progress, and a stream silent for ``silence_s`` whose server then fails its health check
  is ``ServerStalled``; a stream cut off is ``BackendUnavailable``;
- a non-2xx status: ``BackendHTTPError`` (carries URL, status and the body). A client built with
  a ``StatusRetry`` first retries a 429 or 5xx reply (``OpenAIBackend`` does: hosted APIs answer
  rate limits and overload that way and expect a retry): it waits what ``Retry-After`` asks
  (seconds or an HTTP date), else ``backoff_s * 2**attempt``, never more than ``cap_s``.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from engine.errors import (
    BackendError,
    BackendHTTPError,
    BackendProtocolError,
    BackendUnavailable,
    ConfigError,
    ReplyCutOff,
    ServerStalled,
)

__all__ = ["HTTPSettings", "JSONClient", "StatusRetry", "check_base_url", "retry_after_s"]

log = logging.getLogger(__name__)

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})
DONE_EVENT = b"data: [DONE]"
T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class StatusRetry:
    """How often and how long to retry a 429 / 5xx reply (see the module docstring)."""

    retries: int = 4
    backoff_s: float = 0.5
    cap_s: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 0 or self.backoff_s < 0 or self.cap_s < 0:
            raise ConfigError(
                f"StatusRetry: retries, backoff_s and cap_s must be >= 0, got {self}"
            )

    def delay_s(self, attempt: int, retry_after: str | None, *, now: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        asked = retry_after_s(retry_after, now=now)
        wait = asked if asked is not None else self.backoff_s * (2**attempt)
        return min(max(wait, 0.0), self.cap_s)


def retry_after_s(value: str | None, *, now: float | None = None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds or HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - (time.time() if now is None else now), 0.0)


@dataclass(frozen=True, kw_only=True)
class HTTPSettings:
    """Timeouts, pool size and the connect-retry policy of one backend's client."""

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0  # a long generation is one long read
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 60.0
    max_connections: int = 256
    connect_retries: int = 3
    retry_backoff_s: float = 0.2
    trust_env: bool = False  # an HTTP_PROXY meant for the internet must not catch cluster traffic

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s", "write_timeout_s", "pool_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"HTTPSettings.{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ConfigError(
                f"HTTPSettings.max_connections must be >= 1, got {self.max_connections}"
            )
        if self.connect_retries < 0 or self.retry_backoff_s < 0:
            raise ConfigError("HTTPSettings.connect_retries and retry_backoff_s must be >= 0")

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(
            connect=self.connect_timeout_s,
            read=self.read_timeout_s,
            write=self.write_timeout_s,
            pool=self.pool_timeout_s,
        )


def check_base_url(url: str, *, what: str) -> str:
    """``url`` without a trailing slash; ``ConfigError`` unless it is an http(s) URL with a host."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ConfigError(f"{what}: {url!r} is not a valid URL ({exc})") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"{what}: {url!r} must be an http:// or https:// URL with a host")
    return url.rstrip("/")


class JSONClient:
    """JSON over one pooled ``httpx.AsyncClient`` (see the module docstring)."""

    def __init__(
        self,
        *,
        base_url: str,
        settings: HTTPSettings,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        status_retry: StatusRetry | None = None,
    ) -> None:
        self.base_url = base_url
        self.settings = settings
        self.status_retry = status_retry
        self._transport = transport
        self._headers = dict(headers or {})
        self._client: httpx.AsyncClient | None = None

    def _get_client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(
                max_connections=self.settings.max_connections,
                max_keepalive_connections=self.settings.max_connections,
            )
            self._client = httpx.AsyncClient(
                timeout=self.settings.timeout(),
                limits=limits,
                transport=self._transport,
                headers=self._headers,
                trust_env=self.settings.trust_env,
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def post(self, path: str, payload: Any) -> Any:
        """POST ``payload`` as JSON; the decoded JSON reply (None for an empty body)."""
        return await self._request("POST", path, payload)

    async def get(self, path: str) -> Any:
        return await self._request("GET", path, None)

    async def _request(self, method: str, path: str, payload: Any) -> Any:
        retry = self.status_retry
        attempt = 0
        while True:
            response = await self._send(method, path, payload)
            if (
                retry is None
                or response.status_code not in RETRIED_STATUSES
                or attempt >= retry.retries
            ):
                return self._decode(method, response)
            delay = retry.delay_s(attempt, response.headers.get("retry-after"))
            log.warning(
                "%s %s answered HTTP %d; retry %d/%d in %.1fs",
                method,
                response.url,
                response.status_code,
                attempt + 1,
                retry.retries,
                delay,
            )
            await asyncio.sleep(delay)
            attempt += 1

    async def _send(
        self, method: str, path: str, payload: Any, *, stream: bool = False
    ) -> httpx.Response:
        url = self.base_url + path
        client = self._get_client()
        request = client.build_request(method, url, json=payload if method == "POST" else None)
        attempts = self.settings.connect_retries + 1
        for attempt in range(attempts):
            try:
                return await client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing was sent, so trying again cannot run the request twice.
                if attempt + 1 == attempts:
                    raise BackendUnavailable(
                        f"{method} {url}: could not connect after {attempts} attempt(s): "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                await asyncio.sleep(self.settings.retry_backoff_s * (2**attempt))
            except httpx.HTTPError as exc:
                raise self._failed(method, url, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _failed(self, method: str, url: str, exc: httpx.HTTPError) -> BackendError:
        """Our error for an httpx failure after the request may have been sent (not retried:
        a ``/generate`` the server already ran would run twice)."""
        if isinstance(exc, httpx.TimeoutException):
            return BackendUnavailable(
                f"{method} {url}: {type(exc).__name__} (timeouts: read "
                f"{self.settings.read_timeout_s}s, write {self.settings.write_timeout_s}s, "
                f"pool {self.settings.pool_timeout_s}s); not retried because the server may "
                "already have run the request"
            )
        if isinstance(exc, httpx.RemoteProtocolError):
            return ReplyCutOff(
                f"{method} {url}: the reply is not well-formed HTTP or was cut short: {exc}"
            )
        if isinstance(exc, httpx.DecodingError):
            return BackendProtocolError(f"{method} {url}: the reply does not decode: {exc}")
        if isinstance(exc, httpx.TransportError):
            return BackendUnavailable(
                f"{method} {url}: connection failed during the request: "
                f"{type(exc).__name__}: {exc}; not retried"
            )
        return BackendError(f"{method} {url}: {type(exc).__name__}: {exc}")  # pragma: no cover

    async def post_events(
        self,
        path: str,
        payload: Any,
        *,
        silence_s: float,
        alive: Callable[[], Awaitable[bool]],
    ) -> Any:
        """POST ``payload`` for a server-sent event stream (``data: <json>`` events, then
        ``data: [DONE]``); the last event before ``[DONE]``, decoded. Any bytes from the
        server are progress: after ``silence_s`` without any, ``alive()`` decides (True: wait
        on) and else ``ServerStalled``. A stream cut off (the server died, the connection was
        reset) is ``BackendUnavailable``; an ``{"error": ...}`` event is ``BackendHTTPError``."""
        url = self.base_url + path
        # a server that stops before its headers stalls the call as surely as one mid-stream
        response = await _watched(self._send("POST", path, payload, stream=True),
                                  url, silence_s, alive)  # fmt: skip
        try:
            if not response.is_success:
                await response.aread()
                raise BackendHTTPError(url, response.status_code, response.text)
            last = await _last_event(response.aiter_bytes(), url, silence_s, alive)
        except httpx.HTTPError as exc:
            cut = BackendUnavailable(f"POST {url}: the event stream was cut off: {exc!r}")
            raise cut from exc
        finally:
            await response.aclose()
        try:
            body = json.loads(last)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BackendProtocolError(
                f"POST {url}: the last event is not JSON ({exc}): {last[:200]!r}"
            ) from exc
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict):
            raise BackendHTTPError(url, int(error.get("code") or 400), str(error.get("message")))
        return body

    def _decode(self, method: str, response: httpx.Response) -> Any:
        url = str(response.request.url)
        if not response.is_success:
            raise BackendHTTPError(url, response.status_code, response.text)
        if not response.content:
            return None
        try:
            return json.loads(response.content)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BackendProtocolError(
                f"{method} {url}: HTTP {response.status_code} reply is not JSON ({exc}): "
                f"{response.text[:200]!r}"
            ) from exc


async def _watched(step: Awaitable[T], url: str, silence_s: float,
                   alive: Callable[[], Awaitable[bool]]) -> T:  # fmt: skip
    """``step``'s result; each ``silence_s`` without it, ``alive()`` decides whether to wait
    on (True) or give it up as ``ServerStalled``."""
    task = asyncio.ensure_future(step)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=silence_s)
            if done:
                return task.result()
            if not await alive():
                raise ServerStalled(
                    f"POST {url}: no event for {silence_s:g} s and the server failed its "
                    "health check: the generation is stalled"
                )
    finally:
        if not task.done():
            task.cancel()


async def _last_event(
    chunks: AsyncIterator[bytes],
    url: str,
    silence_s: float,
    alive: Callable[[], Awaitable[bool]],
) -> bytes:
    """The payload of the last ``data:`` event of a stream before ``[DONE]`` (see
    ``JSONClient.post_events``); earlier events are only found, never decoded. A stream
    that ends without ``[DONE]`` was cut off."""
    buffer = b""
    last: bytes | None = None
    it = chunks.__aiter__()
    while True:
        try:
            piece = await _watched(it.__anext__(), url, silence_s, alive)
        except StopAsyncIteration:
            break
        buffer += piece
        end = buffer.rfind(b"\n\n")
        if end < 0:
            continue
        events, buffer = buffer[:end], buffer[end + 2 :]
        for event in events.split(b"\n\n"):
            if event == DONE_EVENT and last is not None:
                return last
            if event.startswith(b"data: "):
                last = event[6:]
    raise BackendUnavailable(
        f"POST {url}: the event stream ended before its last event (data: [DONE])"
    )
