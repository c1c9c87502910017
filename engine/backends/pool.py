"""``BackendPool``: the model backends one worker process holds, one per model endpoint.

Episodes never build backends. The worker builds one ``BackendPool`` when it starts, hands it to
every episode through ``EpisodeContext.backends`` and closes it when it stops, so the concurrent
episodes of a worker share one pooled HTTP client per endpoint instead of opening (and tearing
down) one per episode.

- ``get()`` answers the worker's policy endpoint (``--sglang-url``); ``get(url)`` another
  endpoint (an agent bound to its own server). Each endpoint's backend is built by ``build`` on
  first use and reused by every later episode; URLs that differ only by a trailing slash are the
  same endpoint.
- The default ``build`` is a token-level ``SGLangBackend`` without a tokenizer: token-level
  callers send ``input_ids`` and read ``token_ids`` back, so the pool needs no model folder.
- Like the backends it holds, a pool belongs to one event loop (the worker's).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from engine.backends._http import check_base_url
from engine.backends.base import ModelBackend
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.errors import BackendUnavailable, ConfigError

__all__ = ["BackendBuilder", "BackendPool", "sglang_backend"]

BackendBuilder = Callable[[str], ModelBackend]
"""Builds the backend of one endpoint from its base URL (called once per endpoint)."""


def sglang_backend(url: str) -> ModelBackend:
    """The default builder: a token-level ``SGLangBackend`` on ``url``."""
    return SGLangBackend(config=SGLangConfig(url=url))


class BackendPool:
    """One ``ModelBackend`` per model endpoint (see the module docstring)."""

    def __init__(self, default_url: str | None = None, *, build: BackendBuilder = sglang_backend):
        self.default_url = (
            check_base_url(default_url, what="the worker's model endpoint") if default_url else None
        )
        self._build = build
        self._backends: dict[str, ModelBackend] = {}
        self._closed = False

    def get(self, url: str | None = None) -> ModelBackend:
        """The backend of ``url`` (``None``: the default endpoint), built on first use."""
        if self._closed:
            raise BackendUnavailable(
                "the worker's backend pool is closed (the worker is stopping); no new generations"
            )
        if url:
            endpoint = check_base_url(url, what="model endpoint")
        elif self.default_url is not None:
            endpoint = self.default_url
        else:
            raise ConfigError(
                "no model endpoint: the agent names none and the worker has no default "
                "(run it with --sglang-url)"
            )
        backend = self._backends.get(endpoint)
        if backend is None:
            backend = self._backends[endpoint] = self._build(endpoint)
        return backend

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints whose backend has been built, in the order they were first asked for."""
        return tuple(self._backends)

    async def aclose(self) -> None:
        """Close every backend (each releases its pooled client); later ``get`` calls fail."""
        self._closed = True
        backends, self._backends = list(self._backends.values()), {}
        for backend in backends:
            await backend.aclose()

    async def __aenter__(self) -> BackendPool:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
