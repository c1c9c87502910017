"""``ServerHealth``: the state of each policy server of one worker, shared by all its episodes.

A ``BackendPool`` holds one tracker for its policy servers and runs it as a hook around
every model call (``engine/backends/hooks.py``), after the worker's ``TurnGate``. Each server
is in one of three states (``ServerState``):

- ``up``: it takes new trajectories and turns;
- ``down``: a call could not connect, was cut off or stalled (``BackendUnavailable``,
  ``ServerStalled``), or a probe failed. While the worker's gate is closed for a weight sync a
  stall marks nothing (a server paused for a sync does not answer, and is not dead);
- ``stale``: it answers, but reports a weight version other than the active policy version
  (``expected()``, from ``rl:control``): a server restarted from older weights, or started
  without ``--weight-version`` (SGLang's ``"default"``, read as None). It needs a sync;
  until it reports the active version it gets nothing. A result of an up server that reports
  another version (it restarted between two calls) makes it stale too.

A server that is not up is probed every ``probe_every_s`` by ``run``: ``health(generate=
True)`` (SGLang's ``/health_generate``: one generation step, about a second; a paused server
answers 503 after 20 s) within ``probe_timeout_s``, then its version (below). It is up again
once both answer and the version is the active one (any known one while none is active:
nothing says which weights are right before the first sync). Every change goes to the
listeners (``listen``): the worker appends ``ServerDown`` / ``ServerUp`` / ``ServerStale`` to
the log.

Every server is at a known version before it serves. ``admit()``, awaited by the worker
before it takes work, judges each up server's version as a probe does (one it cannot read is
down, and probed). A server that reports none (SGLang's ``"default"``: no
``--weight-version``) while no version is active and no sync is open holds the policy the run
starts from: admission and probes label it ``FIRST_VERSION`` (``ServerAdmin.set_version``,
without the admin key, which workers never hold) before it gets a turn. One that refuses the
label (401/403: an admin key; 404: no such route) would serve at an unknown version: at
admission that is a ``ConfigError`` naming the fix (``--weight-version 0``, as ``rollout
serve`` passes); a probe keeps it down with that reason, logged as an error. A backend
without the ``weight_version`` capability is admitted as it is, with a warning.

``available()`` returns at once while a server is up; while none is, new turns wait there for
one to come back, and past ``outage_limit_s`` of all of them down it raises ``ServersDown``.

Eval servers (``add(url, fixed=True)``: registered in the ``eval`` role, kept at the version
they were started with) are tracked and probed the same way, but apart from the policy: they
are never stale (their version is whatever they report, never labelled; one that reports
none stays down), take no policy trajectory (``up_urls``, ``any_up`` and ``available`` are
the policy servers'), a stall while a sync is open marks them down (no sync pauses them) and
their changes are not announced (the fleet's word on ``rl:control`` is about the policy).
``serving(v)`` are the servers a trajectory pinned to version ``v`` may run on: the eval
servers up at ``v``, else the policy servers up at ``v`` while no sync is open;
``serving_available(v)`` waits for one, up to the outage limit.

``RetryBudget`` is one sample's allowance of retried model calls and re-run attempts
(``engine/backends/pool.py``, ``engine/actors/batch_run.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from engine import metrics
from engine.backends.base import GenerationResult, ModelBackend
from engine.backends.gate import TurnGate
from engine.backends.hooks import ModelCall
from engine.backends.weight_admin import ServerAdmin
from engine.errors import (
    BackendHTTPError,
    BackendProtocolError,
    BackendUnavailable,
    ConfigError,
    ServersDown,
    ServerStalled,
)

__all__ = [
    "FIRST_VERSION",
    "HealthChange",
    "RetryBudget",
    "ServerHealth",
    "ServerState",
    "infra_failure",
]

FIRST_VERSION = 0
"""The version of the policy the servers start from, before any sync."""

logger = logging.getLogger(__name__)


class ServerState(StrEnum):
    UP = "up"
    DOWN = "down"
    STALE = "stale"


@dataclass(frozen=True, slots=True)
class HealthChange:
    """A server changed state: why, and the version it reported (None: unknown)."""

    endpoint: str
    state: ServerState
    reason: str
    version: int | None = None
    expected: int | None = None


def infra_failure(error: BaseException | None) -> bool:
    """A failure of the server or the way to it (retried, never an outcome of the policy)."""
    return isinstance(error, BackendUnavailable)


@dataclass(slots=True)
class RetryBudget:
    """One sample's retries: ``tries`` retried calls or re-run attempts in all, with a pause
    of ``backoff_s * 2**n`` (at most ``cap_s``) before retry ``n``. ``servers`` are those a
    failed call was sent to, in order; ``reached_caller`` says a failure of a server went to
    the agent (a call that cannot be retried on its own, or the budget was spent)."""

    tries: int = 4
    backoff_s: float = 0.5
    cap_s: float = 10.0
    used: int = 0
    servers: list[str] = field(default_factory=list)
    reached_caller: bool = False
    last: str = ""

    def take(self, url: str | None, what: str) -> bool:
        """Count one failure; whether a retry is left for it."""
        self.used += 1
        self.last = what
        if url and url not in self.servers:
            self.servers.append(url)
        return self.used <= self.tries

    @property
    def spent(self) -> bool:
        return self.used > self.tries

    def pause_s(self) -> float:
        return min(self.cap_s, self.backoff_s * (1 << max(0, self.used - 1)))

    def describe(self) -> str:
        tried = ", ".join(self.servers) or "none"
        return f"retry budget of {self.tries} spent (servers tried: {tried}; last: {self.last})"


Listener = Callable[[HealthChange], None]


class ServerHealth:
    """See the module docstring. ``backend(url)`` gives a server's own backend (to probe);
    ``admin(url)`` the weight routes that label a server's first version."""

    def __init__(
        self,
        urls: Sequence[str],
        backend: Callable[[str], ModelBackend],
        gate: TurnGate,
        *,
        outage_limit_s: float | None = 300.0,
        probe_every_s: float = 1.0,
        probe_timeout_s: float = 25.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.urls = tuple(urls)
        self._backend = backend
        self.gate = gate
        self.outage_limit_s = outage_limit_s
        self.probe_every_s = probe_every_s
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self.expected: Callable[[], int | None] = lambda: None
        self.admin: Callable[[str], ServerAdmin] = ServerAdmin
        self.states = dict.fromkeys(self.urls, ServerState.UP)
        self.fixed: set[str] = set()  # eval servers: kept at their own version
        self.reasons: dict[str, str] = {}
        self._reported: dict[str, int | None] = dict.fromkeys(self.urls)
        self._n_up = len(self.urls)  # policy servers up
        self._up = asyncio.Event()
        if self._n_up:
            self._up.set()
        self._down_since = clock()
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # any change of state (pinned waits look again)
        self._listeners: list[Listener] = []
        self._gauges = {url: metrics.SERVER_UP.labels(url) for url in self.urls}
        for gauge in self._gauges.values():
            gauge.set(1)

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def is_up(self, url: str) -> bool:
        return self.states.get(url) is ServerState.UP

    @property
    def any_up(self) -> bool:
        return self._n_up > 0

    def up_urls(self) -> tuple[str, ...]:
        """The policy servers that are up."""
        fixed = self.fixed
        return tuple(u for u, s in self.states.items() if s is ServerState.UP and u not in fixed)

    def version_of(self, url: str) -> int | None:
        """The weight version an up server serves (None: not up, or unknown)."""
        if self.states.get(url) is not ServerState.UP:
            return None
        expected = None if url in self.fixed else self.expected()
        return self._reported.get(url) if expected is None else expected

    def serving(self, version: int) -> tuple[str, ...]:
        """The servers a trajectory pinned to ``version`` may run on (module docstring)."""
        found = tuple(u for u in self.fixed if self.version_of(u) == version)
        if found or not self.gate.is_open:
            return found
        return tuple(u for u in self.up_urls() if self.version_of(u) == version)

    def describe_versions(self) -> str:
        """Each tracked server's state and version, for the message of a wait that failed."""
        expected = self.expected()
        parts = []
        for url, state in self.states.items():
            role = "eval" if url in self.fixed else "policy"
            version = self._reported.get(url) if url in self.fixed else expected
            parts.append(f"{url} ({role}, {state.value}, version {version})")
        return "; ".join(parts) or "no server registered"

    def adopt(self, states: Mapping[str, str]) -> None:
        """Start from what the log says (a server another worker saw down is probed first)."""
        for url, state in states.items():
            if url in self.states and state != ServerState.UP:
                self._set(url, ServerState(state), "as the log has it", announce=False)

    def add(self, url: str, *, fixed: bool = False) -> None:
        """Track ``url`` too (a server registered while the worker runs): down until a probe
        finds it answering at the active version (``fixed``, an eval server: at a version it
        reports). A server tracked in the other role changes role."""
        if url in self.states:
            if (url in self.fixed) == fixed:
                return
            self.remove(url, fixed=not fixed)
        if fixed:
            self.fixed.add(url)
        self.urls = (*self.urls, url)
        self.states[url] = ServerState.DOWN
        self.reasons[url] = "registered, not probed yet"
        self._reported[url] = None
        self._gauges[url] = metrics.SERVER_UP.labels(url)
        self._gauges[url].set(0)
        self._wake.set()

    def remove(self, url: str, *, fixed: bool = False) -> None:
        """Stop tracking ``url`` (a retired server): it gets nothing any more. Only a server
        tracked in that role (``fixed``: an eval server) is removed."""
        if url not in self.states or (url in self.fixed) != fixed:
            return
        state = self.states.pop(url)
        self.urls = tuple(u for u in self.urls if u != url)
        self._gauges.pop(url).set(0)
        if url in self.fixed:
            self.fixed.discard(url)
        elif state is ServerState.UP:
            self._n_up -= 1
            if self._n_up == 0:
                self._up.clear()
                self._down_since = self._clock()

    # -- changes ---------------------------------------------------------------------------

    def mark(self, url: str, state: ServerState, reason: str, version: int | None = None) -> None:
        """Put ``url`` in ``state`` (a server the pool does not track is ignored)."""
        if url in self.states:
            self._set(url, state, reason, version=version)

    def _set(
        self,
        url: str,
        state: ServerState,
        reason: str,
        *,
        version: int | None = None,
        announce: bool = True,
    ) -> None:
        before = self.states.get(url)
        if before is None:  # removed while its probe ran
            return
        if before is state and (state is not ServerState.STALE or self._reported[url] == version):
            if version is not None:
                self._reported[url] = version
            return
        self.states[url] = state
        self.reasons[url] = reason
        self._reported[url] = version
        fixed = url in self.fixed
        if (before is ServerState.UP) != (state is ServerState.UP):
            self._gauges[url].set(1 if state is ServerState.UP else 0)
        if not fixed and (before is ServerState.UP) != (state is ServerState.UP):
            self._n_up += 1 if state is ServerState.UP else -1
            if self._n_up == 0:
                self._up.clear()
                self._down_since = self._clock()
            else:
                self._up.set()
        if state is not ServerState.UP:
            self._wake.set()
        self._changed.set()
        metrics.SERVER_CHANGES.labels(url, state.value).inc()
        log = logger.info if state is ServerState.UP else logger.warning
        log("model server %s is %s: %s", url, state.value, reason)
        if announce and not fixed:
            self._announce(url, state, reason, version)

    def _announce(self, url: str, state: ServerState, reason: str, version: int | None) -> None:
        change = HealthChange(url, state, reason, version, self.expected())
        for listener in self._listeners:
            listener(change)

    # -- the hook --------------------------------------------------------------------------

    async def before(self, call: ModelCall) -> None:
        return None

    def after(
        self, call: ModelCall, result: GenerationResult | None, error: BaseException | None
    ) -> None:
        if call.url in self.fixed:
            self._after_fixed(call.url, result, error)
            return
        if error is None:
            if result is not None and self.wrong_version(result):
                self.mark(
                    call.url,
                    ServerState.STALE,
                    f"it served a turn at another weight version ({result.weight_version})",
                    result.weight_version,
                )
            return
        if not infra_failure(error) or (isinstance(error, ServerStalled) and not self.gate.is_open):
            return
        self.mark(call.url, ServerState.DOWN, str(error))

    def _after_fixed(
        self, url: str, result: GenerationResult | None, error: BaseException | None
    ) -> None:
        """An eval server's call ended: a failure marks it down (no sync pauses it); a result
        tells its version (a restart may have loaded other weights)."""
        if error is not None:
            if infra_failure(error):
                self.mark(url, ServerState.DOWN, str(error))
        elif result is not None and result.weight_version is not None:
            self._reported[url] = result.weight_version

    def wrong_version(self, result: GenerationResult) -> bool:
        """The result was generated at a version other than the active one (while no sync
        is under way: a sync moves versions under calls that started before it)."""
        expected = self.expected()
        return expected is not None and result.weight_version != expected and self.gate.is_open

    # -- waiting and probing ---------------------------------------------------------------

    async def available(self) -> None:
        """Return once a server is up; ``ServersDown`` past the outage limit without one."""
        while not self._n_up:
            limit = self.outage_limit_s
            waited = self._clock() - self._down_since
            if limit is not None and waited >= limit:
                raise ServersDown(
                    f"every policy server has been down for {waited:.0f} s (outage limit "
                    f"{limit:g} s): "
                    + "; ".join(f"{u} ({self.reasons.get(u, '?')})" for u in self.urls
                                if u not in self.fixed)
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._up.wait(), None if limit is None else limit - waited)

    async def serving_available(self, version: int) -> tuple[str, ...]:
        """The servers of ``serving(version)`` once there is one; ``ServersDown`` naming what
        was waited for past the outage limit."""
        start = self._clock()
        while not (found := self.serving(version)):
            limit = self.outage_limit_s
            waited = self._clock() - start
            if limit is not None and waited >= limit:
                raise ServersDown(
                    f"no model server serves weight version {version}, the version the "
                    f"rollout is pinned to, for {waited:.0f} s (outage limit {limit:g} s; "
                    f"start an eval server at it: rollout serve --role eval --model PATH "
                    f"--weight-version {version}): {self.describe_versions()}"
                )
            with contextlib.suppress(TimeoutError):  # a change of state, or the next look
                await asyncio.wait_for(self._changed.wait(), self.probe_every_s)
            self._changed.clear()
        return found

    async def run(self, stop: asyncio.Event) -> None:
        """Probe each server that is not up, every ``probe_every_s`` (one probe at a time per
        server: a hung one does not hold up the others), until ``stop``."""
        probes: dict[str, asyncio.Task[None]] = {}
        try:
            while not stop.is_set():
                self._wake.clear()
                down = [u for u, s in self.states.items() if s is not ServerState.UP]
                for url in down:
                    task = probes.get(url)
                    if task is None or task.done():
                        probes[url] = asyncio.ensure_future(self.probe(url))
                waits = [asyncio.ensure_future(e.wait()) for e in (stop, self._wake)]
                try:
                    await asyncio.wait(
                        waits,
                        timeout=self.probe_every_s if down else None,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            for task in probes.values():
                task.cancel()
            await asyncio.gather(*probes.values(), return_exceptions=True)

    async def admit(self) -> None:
        """Bring every up server to a known version before it serves (module docstring);
        ``ConfigError`` names a server that refuses its label."""
        outcomes = await asyncio.gather(
            *(self._admit(url) for url in self.up_urls()), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _admit(self, url: str) -> None:
        backend = self._backend(url)
        if not backend.capabilities.weight_version:
            logger.warning("model server %s (%r) cannot report its weight version: admitted as "
                           "it is, its turns carry no version", url, backend)  # fmt: skip
            return
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                version = await self._known_version(url, backend)
        except (ConfigError, asyncio.CancelledError):
            raise
        except Exception as exc:
            self._set(url, ServerState.DOWN, f"admission failed: {exc!r}")
            return
        self._judge(url, version, "admitted")

    async def probe(self, url: str) -> None:
        """One probe of a server that is not up (see the module docstring)."""
        backend = self._backend(url)
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                await backend.health(generate=True)
                version = await self._known_version(url, backend)
        except asyncio.CancelledError:
            raise
        except ConfigError as exc:  # it would serve at an unknown version: kept out
            reason = str(exc)
            if self.reasons.get(url) != reason:  # said once, with the reason the log keeps
                logger.error("model server %s stays down: %s", url, reason)
                self._set(url, ServerState.DOWN, reason, announce=False)
                self.reasons[url] = reason
                self._announce(url, ServerState.DOWN, reason, None)
            return
        except Exception as exc:
            if self.gate.is_open or url in self.fixed:  # a sync pauses policy servers only
                self._set(url, ServerState.DOWN, f"health probe failed: {exc!r}")
            return
        self._judge(url, version, "it answers /health_generate")

    def _judge(self, url: str, version: int | None, why: str) -> None:
        """Up at the active version (any while none is active), else stale; an eval server
        is up at any version it reports, down while it reports none."""
        if url in self.fixed:
            if version is None:  # kept down, saying why (it may be down already)
                reason = ("eval server reports no weight version (SGLang's \"default\"): start "
                          "it with --weight-version")  # fmt: skip
                self._set(url, ServerState.DOWN, reason)
                self.reasons[url] = reason
            else:
                self._set(url, ServerState.UP, why, version=version)
            return
        expected = self.expected()
        if expected is None or version == expected:
            self._set(url, ServerState.UP, why, version=version)
        else:
            shown = 'unknown ("default")' if version is None else str(version)
            self._set(
                url,
                ServerState.STALE,
                f"it reports weight version {shown}, the active one is {expected}",
                version=version,
            )

    async def _known_version(self, url: str, backend: ModelBackend) -> int | None:
        """The server's version, labelled ``FIRST_VERSION`` first when it reports none while
        no version is active and no sync is open."""
        version = await backend.weight_version()
        fixed = url in self.fixed  # an eval server keeps what it reports
        if fixed or version is not None or self.expected() is not None or not self.gate.is_open:
            return version
        admin = self.admin(url)
        try:
            await admin.set_version(FIRST_VERSION)
        except BackendHTTPError as exc:
            if exc.status not in (401, 403, 404):
                raise
            raise ConfigError(
                f"model server {url} reports no weight version (SGLang's \"default\": started "
                f"without --weight-version) and refused to be labelled version {FIRST_VERSION}, "
                f"the policy it starts from ({exc}); its turns would carry no version. Start "
                f"it with --weight-version {FIRST_VERSION} (rollout serve does)"
            ) from exc
        finally:
            await admin.aclose()
        version = await backend.weight_version()
        if version != FIRST_VERSION:
            raise BackendProtocolError(
                f"{url} reports weight version {version} after being labelled {FIRST_VERSION}"
            )
        logger.info("model server %s reported no weight version: labelled %d, the policy the "
                    "servers start from", url, FIRST_VERSION)  # fmt: skip
        return version
