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
- The default ``build`` is a token-level, streaming ``SGLangBackend`` without a tokenizer:
  token-level callers send ``input_ids`` and read ``token_ids`` back, so the pool needs no
  model folder.
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
- Health (``engine/backends/health.py``): the pool's second hook is ``health``, one tracker of
  the policy's servers shared by every view. A server that is not up gets no new trajectory,
  and a trajectory placed on it moves to the up server with the fewest trajectories at its
  next call: turns are token ids, so nothing ties a trajectory to a server but its prefix
  cache. While no server is up, a view's calls wait for one (``ServersDown`` past the outage
  limit).
- Discovery: ``use_servers(urls)`` makes ``urls`` the policy's servers from then on (a worker
  following the servers registered on ``rl:control`` calls it on every change). A new server is
  tracked as down until the health probe admits it at the active version; a server no longer
  listed gets nothing more, and the trajectories placed on it move at their next call, as for
  a down server. While none is listed, calls wait as while none is up.
- Pinned versions: ``use_eval_servers(urls)`` gives the pool eval servers, kept at the
  version each was started with (the syncer never loads them); the health tracker probes them
  apart from the policy (``ServerHealth.add(url, fixed=True)``). A view bound with
  ``version=v`` (an eval request's ``pinned_version``) runs only on servers serving ``v``
  (``ServerHealth.serving``): an eval server up at ``v``, else a policy server up at ``v``
  while no sync is open; kept on one while it serves ``v``, waiting while none does
  (``ServersDown`` past the outage limit, naming the version). Its calls on an eval server
  skip the ``TurnGate``: a weight sync of the policy servers neither waits for them nor holds
  them. A result of another version is never handed back: the turn is retried within the
  budget, or the call fails as an infrastructure failure (the attempt is re-run).
- Retries: a view's ``get()`` is a ``RoutedBackend``. It names each generate call
  ``KEY/tN`` (a new N per call, so an abort reaches exactly one request), and with a
  ``RetryBudget`` (``bind(key, budget=...)``, one per sample) it retries a token-level
  generate (``input_ids``, a backend with the abort capability, no rid of the caller's) that
  failed for the server's sake: could not connect, was cut off or stalled
  (``BackendUnavailable``), came back aborted by the server, or was served at a weight
  version other than the active one. The turn runs again from the same tokens on a server
  that is up, after a pause (``RetryBudget.pause_s``); the request of a call that raised is
  aborted by its rid where it may still run. A call that returned nothing to the agent
  recorded no turn, so nothing is recorded twice. When a retry is refused by a hook (the
  sample ended meanwhile) the aborted result stands; when the budget is spent, or a failed
  call is of another kind (chat, a forwarded pass-through), the failure goes to the agent
  and ``budget.reached_caller`` says so: the attempt is then re-run (``batch_run``).

- Interruption: a view's token-level generate (``input_ids``, a backend with the abort
  capability, no rid of the caller's) is *resumable*: when a weight sync interrupts it (the
  gate aborts it, ``TurnGate.interrupt``), the turn is continued once the gate opens, from
  the prompt plus the partial tokens with the token budget reduced by them, on the new
  weights (``engine/backends/continuation.py``). The agent gets one result: the partial
  tokens with the logprobs and the version they were sampled with, then the continuation's
  (``GenerationResult.token_versions``). An interruption takes nothing from the budget and
  is never the agent's failure.
- ``bind(key, max_version_span=N)``: before each turn and before continuing an interrupted
  one (once the gate is open, so against the version it would run on), a trajectory whose
  oldest token version and the active version would span more than ``N`` versions is not
  generated further: the turn ends with what it has, ``finish_reason`` ``version_span``
  (``FinishReason.VERSION_SPAN``), and the agent ends the episode for that reason.

A router (``sglang-router``) in front of the servers is the other way to run several: give the
worker the router's URL as its one endpoint, and the router keeps a conversation's requests on
one server with its own cache-aware policy (see docs/sglang.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType

from engine.backends._http import check_base_url
from engine.backends.base import ModelBackend
from engine.backends.gate import TurnGate
from engine.backends.health import RetryBudget, ServerHealth
from engine.backends.hooks import CallHook, HookedBackend
from engine.backends.routing import BackendBuilder, RoutedBackend, Shared, Trajectory
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

logger = logging.getLogger(__name__)


DEFAULT_STALL_S = 20.0


def sglang_backend(url: str) -> ModelBackend:
    """The default builder: a token-level ``SGLangBackend`` on ``url`` whose generations
    stream and are watched for stalls (``DEFAULT_STALL_S``)."""
    return SGLangBackend(config=SGLangConfig(url=url, stall_s=DEFAULT_STALL_S))


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


class BackendPool:
    """One ``ModelBackend`` per model endpoint (see the module docstring)."""

    def __init__(
        self,
        default_url: str | Sequence[str] | None = None,
        *,
        build: BackendBuilder = sglang_backend,
        hooks: Sequence[CallHook] = (),
        outage_limit_s: float | None = 300.0,
    ):
        urls = parse_urls(default_url, what="the worker's model endpoint")
        self._shared = Shared(urls, build, hooks, outage_limit_s)
        self._trajectory: Trajectory | None = None
        self._routed: RoutedBackend | None = None
        self._own: tuple[CallHook, ...] = ()  # a view's own hooks
        self._hooks: tuple[CallHook, ...] = ()  # and the pool's after them (none: no own)

    @property
    def default_urls(self) -> tuple[str, ...]:
        """The policy's servers, in the order given."""
        return self._shared.urls

    def use_servers(self, urls: Sequence[str]) -> None:
        """The policy's servers are ``urls`` from now on (see "Discovery" in the module
        docstring)."""
        self._shared.use(parse_urls(list(urls), what="a registered policy server"))

    def use_eval_servers(self, urls: Sequence[str]) -> None:
        """The eval servers are ``urls`` from now on (see "Pinned versions" in the module
        docstring)."""
        self._shared.use(parse_urls(list(urls), what="a registered eval server"), fixed=True)

    @property
    def eval_urls(self) -> tuple[str, ...]:
        """The eval servers, in the order given."""
        return self._shared.eval_urls

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
    def health(self) -> ServerHealth:
        """The policy servers' health, the pool's second hook (``engine/backends/health.py``);
        the worker runs its probes (``health.run``)."""
        return self._shared.health

    @property
    def key(self) -> str | None:
        """The trajectory this view is bound to (None for the pool itself)."""
        return None if self._trajectory is None else self._trajectory.key

    def bind(
        self,
        key: str,
        *,
        hooks: Sequence[CallHook] = (),
        budget: RetryBudget | None = None,
        version: int | None = None,
        max_version_span: int | None = None,
    ) -> BackendPool:
        """A view of this pool whose ``get()`` keeps trajectory ``key`` on one server while
        it is up, whose calls on the policy's servers pass ``hooks`` first (this view's too),
        whose token-level generations are retried within ``budget`` and continued across a
        weight sync, and whose trajectory spans at most ``max_version_span`` versions;
        ``version`` pins it to the servers serving that weight version (see "Pinned
        versions" in the module docstring)."""
        if not key:
            raise ValueError("BackendPool.bind needs a non-empty trajectory key")
        if max_version_span is not None and max_version_span < 1:
            raise ValueError(f"max_version_span must be >= 1, got {max_version_span}")
        view = object.__new__(BackendPool)
        view._shared = self._shared
        view._trajectory = Trajectory(key, self._shared, budget, version, max_version_span)
        view._routed = None
        view._own = (*self._own, *hooks)
        view._hooks = (*view._own, *self._shared.hooks)
        return view

    def get(self, url: str | None = None, *, key: str | None = None) -> ModelBackend:
        """The backend of ``url`` (``None``: the policy's server for this trajectory), built on
        first use. A trajectory that names one of the pool's own policy servers gets the routed
        backend as well, so its calls are placed, retried and moved by the servers' health."""
        shared = self._shared
        if shared.closed:
            raise BackendUnavailable(
                "the worker's backend pool is closed (the worker is stopping); no new generations"
            )
        if url:
            endpoint = check_base_url(url, what="model endpoint")
            if self._trajectory is not None and endpoint in shared.urls:
                return self._routed_backend(self._trajectory)
        elif not shared.known:
            raise ConfigError(
                "no model endpoint: the agent names none and the worker has no default "
                "(run it with --sglang-url)"
            )
        elif self._trajectory is not None:
            return self._routed_backend(self._trajectory)
        elif len(shared.urls) == 1:
            endpoint = shared.urls[0]
        elif key is not None:
            endpoint = shared.place(key)
        else:  # a one-off call: the least-loaded server that is up, not kept
            urls = shared.health.up_urls() or shared.urls or shared.known
            endpoint = min(urls, key=lambda u: shared.live[u])
        hooked = shared.hooked.get(endpoint)
        if hooked is None:
            backend = shared.backend(endpoint)
            hooked = shared.hooked[endpoint] = HookedBackend(backend, endpoint, shared.hooks)
        if self._own and endpoint in shared.urls:
            return HookedBackend(shared.backends[endpoint], endpoint, self._hooks)
        return hooked

    def _routed_backend(self, trajectory: Trajectory) -> RoutedBackend:
        routed = self._routed
        if routed is None:
            shared = self._shared
            if trajectory.version is not None:  # placed at its first call, among those serving
                url = (shared.health.serving(trajectory.version) or shared.eval_urls
                       or shared.known)[0]  # fmt: skip
            elif len(shared.urls) == 1:
                url = shared.urls[0]
            else:
                url = shared.place(trajectory.key)
            eval_hooks = (*self._own, *shared.eval_hooks)
            routed = self._routed = RoutedBackend(trajectory, url, self._hooks, eval_hooks)
        return routed

    def server_of(self, key: str) -> str | None:
        """The server trajectory ``key`` is kept on (None: not placed, or one server only)."""
        return self._shared.placed.get(key)

    def load(self) -> dict[str, int]:
        """Trajectories bound to each of the policy's servers right now."""
        return {url: self._shared.live[url] for url in self._shared.urls}

    def release(self, key: str | None = None) -> None:
        """End trajectory ``key`` (a view: its own); its server takes new ones again."""
        trajectory = key or self.key
        if trajectory is not None:
            self._shared.release(trajectory)

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints whose backend has been built, in the order they were first asked for."""
        return tuple(self._shared.backends)

    async def aclose(self) -> None:
        """Close every backend (each releases its pooled client); later ``get`` calls fail.

        A bound view only releases its trajectory: the pool's owner closes the pool."""
        if self._trajectory is not None:
            self.release()
            return
        shared = self._shared
        shared.closed = True
        backends, shared.backends = list(shared.backends.values()), {}
        shared.hooked = {}
        for task in list(shared.aborting):
            task.cancel()
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
