"""``BackendPool``: the model backends one worker process holds, one per model endpoint.

Episodes never build backends. The worker builds one ``BackendPool`` when it starts, hands it to
every episode through ``EpisodeContext.backends`` and closes it when it stops, so the concurrent
episodes of a worker share one pooled HTTP client per endpoint instead of opening (and tearing
down) one per episode.

- ``get()`` answers the worker's policy endpoint (``--sglang-url``); ``get(url)`` another
  endpoint (an agent bound to its own server). Each endpoint's backend is built by ``build`` on
  first use and reused by every later episode; URLs that differ only by a trailing slash are the
  same endpoint.
- The policy may be served by several servers (``--sglang-url`` repeated, or a comma-separated
  list). Then ``get()`` picks one per trajectory and keeps it: an episode's pool is
  ``pool.bind(key)`` (the evaluator binds one per attempt), and every ``get()`` of that view
  answers the server the key was first given, so the turns of one trajectory reuse that
  server's prefix cache. A key is given the server with the fewest trajectories bound to it
  at that moment; ties go to the server ranked first for that key by rendezvous hashing, so
  keys spread evenly and the choice does not depend on the order of the list. ``release()``
  ends the view's trajectory (the evaluator calls it after ``cleanup``). ``get(key=...)`` on the
  pool itself does the same for a caller that manages its own keys (``release(key)`` after).
  With one server, or with an explicit ``url``, nothing is balanced.
- The default ``build`` is a token-level ``SGLangBackend`` without a tokenizer: token-level
  callers send ``input_ids`` and read ``token_ids`` back, so the pool needs no model folder.
  Any ``ModelBackend`` may be built instead; callers ask its ``capabilities``.
- Like the backends it holds, a pool belongs to one event loop (the worker's).
- Hooks (``engine/backends/hooks.py``): ``get`` hands out each endpoint's backend wrapped in a
  ``HookedBackend``, so every model call passes the pool's hooks, whatever the backend's
  class. The first is ``gate``, the worker's one ``TurnGate`` (``engine/backends/gate.py``):
  every call of every episode (the tool agent's, the DAgger agent's student turns, the
  recording proxy's, a verification re-score) passes it. The weight sync closes it to quiesce
  the worker and opens it when the new weights are active. ``hooks=`` adds more after it.
  ``bind(key, hooks=...)`` gives a view's calls on the policy's servers hooks of their own
  (the attempt's ``SampleGuard``), run before the pool's; calls to another endpoint (a
  teacher, a judge) pass the pool's hooks only.

A router (``sglang-router``) in front of the servers is the other way to run several: give the
worker the router's URL as its one endpoint, and the router keeps a conversation's requests on
one server with its own cache-aware policy (see docs/sglang.md).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType

from engine.backends._http import check_base_url
from engine.backends.base import ModelBackend
from engine.backends.gate import TurnGate
from engine.backends.hooks import CallHook, HookedBackend
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.errors import BackendUnavailable, ConfigError

__all__ = [
    "BackendBuilder",
    "BackendPool",
    "CallHook",
    "TurnGate",
    "parse_urls",
    "sglang_backend",
]

BackendBuilder = Callable[[str], ModelBackend]
"""Builds the backend of one endpoint from its base URL (called once per endpoint)."""


def sglang_backend(url: str) -> ModelBackend:
    """The default builder: a token-level ``SGLangBackend`` on ``url``."""
    return SGLangBackend(config=SGLangConfig(url=url))


def parse_urls(urls: str | Sequence[str] | None, *, what: str = "--sglang-url") -> tuple[str, ...]:
    """Endpoints from one URL, a comma-separated list, or several of either; checked, in order,
    without duplicates. ``ConfigError`` names the bad entry."""
    if urls is None:
        return ()
    items = [urls] if isinstance(urls, str) else list(urls)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(f"{what}: expected URL strings, got {item!r}")
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            url = check_base_url(part, what=what)
            if url not in out:
                out.append(url)
    return tuple(out)


def _rank(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class _Shared:
    """What the pool and its bound views share: the backends and the trajectory placement."""

    def __init__(
        self, urls: tuple[str, ...], build: BackendBuilder, hooks: Sequence[CallHook]
    ) -> None:
        self.urls = urls
        self.build = build
        self.backends: dict[str, ModelBackend] = {}  # each endpoint's own backend
        self.hooked: dict[str, HookedBackend] = {}  # the same, with the pool's hooks
        self.closed = False
        self.placed: dict[str, str] = {}
        self.live: Counter[str] = Counter()
        self.gate = TurnGate()
        self.hooks: tuple[CallHook, ...] = (self.gate, *hooks)

    def place(self, key: str) -> str:
        url = self.placed.get(key)
        if url is None:
            url = max(self.urls, key=lambda u: (-self.live[u], _rank(key, u)))
            self.placed[key] = url
            self.live[url] += 1
        return url

    def release(self, key: str) -> None:
        url = self.placed.pop(key, None)
        if url is not None:
            self.live[url] -= 1


class BackendPool:
    """One ``ModelBackend`` per model endpoint (see the module docstring)."""

    def __init__(
        self,
        default_url: str | Sequence[str] | None = None,
        *,
        build: BackendBuilder = sglang_backend,
        hooks: Sequence[CallHook] = (),
    ):
        urls = parse_urls(default_url, what="the worker's model endpoint")
        self._shared = _Shared(urls, build, hooks)
        self._key: str | None = None
        self._own: tuple[CallHook, ...] = ()  # a view's own hooks
        self._hooks: tuple[CallHook, ...] = ()  # and the pool's after them (none: no own)

    @property
    def default_urls(self) -> tuple[str, ...]:
        """The policy's servers, in the order given."""
        return self._shared.urls

    @property
    def default_url(self) -> str | None:
        """The policy's first server (the only one, unless several were given)."""
        return self._shared.urls[0] if self._shared.urls else None

    @property
    def gate(self) -> TurnGate:
        """The gate every model call of this pool's backends passes, the pool's first hook
        (see the module docstring); a bound view shares its pool's."""
        return self._shared.gate

    @property
    def key(self) -> str | None:
        """The trajectory this view is bound to (None for the pool itself)."""
        return self._key

    def bind(self, key: str, *, hooks: Sequence[CallHook] = ()) -> BackendPool:
        """A view of this pool whose ``get()`` keeps trajectory ``key`` on one server and
        whose calls on the policy's servers pass ``hooks`` first (this view's too)."""
        if not key:
            raise ValueError("BackendPool.bind needs a non-empty trajectory key")
        view = object.__new__(BackendPool)
        view._shared = self._shared
        view._key = key
        if hooks:
            view._own = (*self._own, *hooks)
            view._hooks = (*view._own, *self._shared.hooks)
        else:
            view._own, view._hooks = self._own, self._hooks
        return view

    def get(self, url: str | None = None, *, key: str | None = None) -> ModelBackend:
        """The backend of ``url`` (``None``: the policy's server for this trajectory), built on
        first use."""
        shared = self._shared
        if shared.closed:
            raise BackendUnavailable(
                "the worker's backend pool is closed (the worker is stopping); no new generations"
            )
        if url:
            endpoint = check_base_url(url, what="model endpoint")
        elif not shared.urls:
            raise ConfigError(
                "no model endpoint: the agent names none and the worker has no default "
                "(run it with --sglang-url)"
            )
        elif len(shared.urls) == 1:
            endpoint = shared.urls[0]
        else:
            trajectory = key or self._key
            if trajectory is None:  # a one-off call: the least-loaded server, not kept
                endpoint = min(shared.urls, key=lambda u: shared.live[u])
            else:
                endpoint = shared.place(trajectory)
        hooked = shared.hooked.get(endpoint)
        if hooked is None:
            backend = shared.backends[endpoint] = shared.build(endpoint)
            hooked = shared.hooked[endpoint] = HookedBackend(backend, endpoint, shared.hooks)
        if self._hooks and (not url or endpoint in shared.urls):
            return HookedBackend(shared.backends[endpoint], endpoint, self._hooks)
        return hooked

    def server_of(self, key: str) -> str | None:
        """The server trajectory ``key`` is kept on (None: not placed, or one server only)."""
        return self._shared.placed.get(key)

    def load(self) -> dict[str, int]:
        """Trajectories bound to each of the policy's servers right now."""
        return {url: self._shared.live[url] for url in self._shared.urls}

    def release(self, key: str | None = None) -> None:
        """End trajectory ``key`` (a view: its own); its server takes new ones again."""
        trajectory = key or self._key
        if trajectory is not None:
            self._shared.release(trajectory)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints whose backend has been built, in the order they were first asked for."""
        return tuple(self._shared.backends)

    async def aclose(self) -> None:
        """Close every backend (each releases its pooled client); later ``get`` calls fail.

        A bound view only releases its trajectory: the pool's owner closes the pool."""
        if self._key is not None:
            self.release()
            return
        shared = self._shared
        shared.closed = True
        backends, shared.backends = list(shared.backends.values()), {}
        shared.hooked = {}
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
