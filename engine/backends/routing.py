"""The routing of a worker's ``BackendPool``: the state its views share (endpoints, the
policy's servers and their health, placements, the turn gate), a bound view's trajectory
(its rids, retry budget, pinned version and version span) and ``RoutedBackend``, the backend
through which a trajectory's calls go where it is placed, retried on an infrastructure failure
and continued across an interrupting weight sync. ``engine.backends.pool`` documents the
behaviour; this module holds its parts."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from engine import metrics
from engine.backends.base import FinishReason, ForceDecodeScore, GenerationResult, ModelBackend
from engine.backends.continuation import joined, rest_of_turn
from engine.backends.gate import TurnGate
from engine.backends.health import RetryBudget, ServerHealth, infra_failure
from engine.backends.hooks import CallHook, CallKind, HookedBackend, ModelCall
from engine.errors import BackendUnavailable

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 5.0

BackendBuilder = Callable[[str], ModelBackend]
"""Builds the backend of one endpoint from its base URL (called once per endpoint)."""


def _rank(key: str, url: str) -> bytes:
    return hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest()


class Shared:
    """What the pool and its bound views share: the backends, the servers' health and the
    trajectory placement."""

    def __init__(
        self,
        urls: tuple[str, ...],
        build: BackendBuilder,
        hooks: Sequence[CallHook],
        outage_limit_s: float | None,
    ) -> None:
        self.urls = urls
        self.known = urls  # every policy server ever listed (a retired one included)
        self.build = build
        self.backends: dict[str, ModelBackend] = {}  # each endpoint's own backend
        self.hooked: dict[str, HookedBackend] = {}  # the same, with the pool's hooks
        self.closed = False
        self.placed: dict[str, str] = {}
        self.live: Counter[str] = Counter()
        self.gate = TurnGate()
        self.health = ServerHealth(urls, self.backend, self.gate, outage_limit_s=outage_limit_s)
        self.hooks: tuple[CallHook, ...] = (self.gate, self.health, *hooks)
        self.eval_hooks: tuple[CallHook, ...] = (self.health, *hooks)  # no gate: no sync
        self.eval_urls: tuple[str, ...] = ()
        self.aborting: set[asyncio.Task[None]] = set()

    def backend(self, url: str) -> ModelBackend:
        backend = self.backends.get(url)
        if backend is None:
            if self.closed:
                raise BackendUnavailable(
                    "the worker's backend pool is closed (the worker is stopping); no new "
                    "generations"
                )
            backend = self.backends[url] = self.build(url)
        return backend

    def place(self, key: str) -> str:
        """The server of trajectory ``key``: where it was placed while that one is up, else
        the up server with the fewest trajectories (ties by rendezvous rank)."""
        url = self.placed.get(key)
        health = self.health
        if url is not None and (health.is_up(url) or (not health.any_up and url in self.urls)):
            return url
        return self.place_among(key, health.up_urls() or self.urls or self.known)

    def place_among(self, key: str, urls: tuple[str, ...]) -> str:
        """The server of trajectory ``key`` among ``urls``: where it was placed while that one
        is among them, else the least loaded (ties by rendezvous rank); a pinned trajectory's
        ``urls`` are those serving its version."""
        url = self.placed.get(key)
        if url is not None:
            if url in urls:
                return url
            self.live[url] -= 1  # its server is down, stale or retired: the trajectory moves
        url = max(urls, key=lambda u: (-self.live[u], _rank(key, u)))
        self.placed[key] = url
        self.live[url] += 1
        return url

    def use(self, urls: tuple[str, ...], *, fixed: bool = False) -> None:
        """The policy's servers (``fixed``: the eval servers) are ``urls`` from now on."""
        health = self.health
        before = self.eval_urls if fixed else self.urls
        for url in urls:
            if url not in before:
                health.add(url, fixed=fixed)
        for url in before:
            if url not in urls:
                health.remove(url, fixed=fixed)
        if fixed:
            self.eval_urls = urls
            return
        self.urls = urls
        self.known = (*self.known, *(u for u in urls if u not in self.known))

    def release(self, key: str) -> None:
        url = self.placed.pop(key, None)
        if url is not None:
            self.live[url] -= 1

    def abort_later(self, backend: ModelBackend, rid: str) -> None:
        """Abort request ``rid`` where a failed call may still run, in the background (the
        server may not answer at all): best effort, bounded."""

        async def abort() -> None:
            try:
                async with asyncio.timeout(_ABORT_TIMEOUT_S):
                    await backend.abort(rid)
            except Exception as exc:  # a dead server runs nothing any more
                logger.debug("abort of %s on %r failed: %r", rid, backend, exc)

        task = asyncio.ensure_future(abort())
        self.aborting.add(task)
        task.add_done_callback(self.aborting.discard)


class Trajectory:
    """A bound view's trajectory: its key, the rids its generate calls are sent with
    (``KEY/tN``, one per call, so each can be aborted by its exact rid), the sample's
    retry budget, and the versions its turns ran on, against ``max_version_span``."""

    __slots__ = ("key", "shared", "budget", "calls", "version", "max_span", "oldest")

    def __init__(
        self, key: str, shared: Shared, budget: RetryBudget | None, version: int | None,
        max_span: int | None,
    ) -> None:
        self.key = key
        self.shared = shared
        self.budget = budget
        self.calls = 0
        self.version = version  # the pinned weight version (None: the active policy)
        self.max_span = max_span
        self.oldest: int | None = None  # the oldest known weight version of its tokens

    def saw(self, result: GenerationResult) -> None:
        known = [v for v in result.versions() if v is not None]
        if known:
            low = min(known)
            self.oldest = low if self.oldest is None else min(self.oldest, low)

    def span_exceeded(self) -> str | None:
        """Why the next tokens, on the active version, would make the trajectory span more
        versions than ``max_span`` (None: they would not, or a version is unknown)."""
        active = self.shared.health.expected()
        if self.max_span is None or self.oldest is None or active is None:
            return None
        span = active - self.oldest + 1
        if span <= self.max_span:
            return None
        return (
            f"trajectory {self.key}: its tokens from version {self.oldest} on and the active "
            f"version {active} would span {span} versions, more than max_version_span "
            f"{self.max_span}"
        )

    def next_rid(self) -> str:
        rid = f"{self.key}/t{self.calls}"
        self.calls += 1
        return rid

    async def endpoint(self) -> tuple[str, ModelBackend]:
        """Where the next call goes: the trajectory's server, placed again when it is not
        up; while none is up, the call waits here (``ServerHealth.available``). A pinned
        trajectory goes to a server serving its version, waiting for one."""
        shared = self.shared
        if self.version is not None:
            found = await shared.health.serving_available(self.version)
            url = shared.place_among(self.key, found)
            return url, shared.backend(url)
        if not shared.health.any_up:
            await shared.health.available()
        url = shared.urls[0] if len(shared.urls) == 1 else shared.place(self.key)
        return url, shared.backend(url)

    def off_version(self, result: GenerationResult) -> str | None:
        """Why ``result`` may not be handed back for its weight version (None: it may)."""
        if self.version is not None:
            if result.weight_version == self.version:
                return None
            return (f"it served weight version {result.weight_version}, the rollout is pinned "
                    f"to {self.version}")  # fmt: skip
        if self.shared.health.wrong_version(result):
            return f"it served weight version {result.weight_version}, not the active one"
        return None


class RoutedBackend(HookedBackend):
    """A bound view's backend on the policy's servers: each call goes where the trajectory
    is placed now, and a token-level generate whose rid the view names is retried on an
    infrastructure failure (see the module docstring)."""

    def __init__(
        self,
        trajectory: Trajectory,
        url: str,
        hooks: tuple[CallHook, ...],
        eval_hooks: tuple[CallHook, ...],
    ) -> None:
        super().__init__(trajectory.shared.backend(url), url, hooks)
        self._trajectory = trajectory
        self._eval_hooks = eval_hooks

    def hooks_for(self, call: ModelCall) -> tuple[CallHook, ...]:
        """An eval server's calls pass no ``TurnGate`` (no sync pauses them)."""
        if call.url in self._trajectory.shared.eval_urls:
            return self._eval_hooks
        return self._hooks

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        t = self._trajectory
        budget = t.budget
        if input_ids is None or rid is not None or not self.capabilities.abort:
            url, inner = await t.endpoint()
            try:
                result = await self._generate(
                    url, inner, input_ids=input_ids, messages=messages, tools=tools,
                    sampling_params=sampling_params, rid=t.next_rid() if rid is None else rid,
                )  # fmt: skip
                if t.version is not None and (why := t.off_version(result)):
                    raise BackendUnavailable(f"{url}: {why}")
                return result
            except Exception as exc:
                if budget is not None and infra_failure(exc):
                    budget.reached_caller = True  # no retry of its own: the attempt is re-run
                raise
        result = await self._turn(t, input_ids, sampling_params)
        t.saw(result)
        return result

    async def _turn(
        self, t: Trajectory, input_ids: Sequence[int], sampling_params: Mapping[str, Any]
    ) -> GenerationResult:
        """One turn, continued from its partial tokens each time a weight sync interrupts
        it (``TurnGate.interrupt``): the prompt plus the tokens so far, with the token
        budget reduced by them, on the weights activated meanwhile. The parts join into one
        result whose tokens keep their logprobs and the version of the part that sampled
        them; a turn whose trajectory would span more than ``max_version_span`` versions is
        not (or no further) generated (``FinishReason.VERSION_SPAN``)."""
        parts: list[GenerationResult] = []
        params: Mapping[str, Any] | None = sampling_params
        gate = t.shared.gate
        while params is not None:
            if t.version is None:  # a pinned eval's server is not synced: no gate to wait on
                await gate.wait_open()  # the span is judged against the version it runs on
            why = t.span_exceeded()
            if why is not None:
                logger.info("%s: ended", why)
                return joined(parts, FinishReason.VERSION_SPAN)
            ids = [*input_ids, *(tok for part in parts for tok in part.token_ids or ())]
            result, interrupted = await self._once(t, ids, params)
            if not (interrupted and result.aborted):
                return joined([*parts, result])
            parts.append(result)
            t.saw(result)
            params = rest_of_turn(sampling_params, sum(len(p.token_ids or ()) for p in parts))
        return joined(parts, FinishReason.LENGTH)  # the budget was spent before the abort

    async def _once(
        self, t: Trajectory, input_ids: Sequence[int], sampling_params: Mapping[str, Any]
    ) -> tuple[GenerationResult, bool]:
        """One generation, retried within the budget when there is one; whether a weight
        sync interrupted it."""
        budget = t.budget
        if budget is not None:
            return await self._retried(t, budget, input_ids, sampling_params)
        url, inner = await t.endpoint()
        call = ModelCall(CallKind.GENERATE, url, inner, t.next_rid(), resumable=True)
        result = await self._generate_call(
            call, input_ids=input_ids, sampling_params=sampling_params
        )
        if t.version is not None and (why := t.off_version(result)):
            raise BackendUnavailable(f"{url}: {why}")  # no budget: the attempt is re-run
        return result, call.interrupted

    async def _retried(
        self,
        t: Trajectory,
        budget: RetryBudget,
        input_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
    ) -> tuple[GenerationResult, bool]:
        """The same turn again from the same tokens, on a server that is up, until it gives
        a result of the active weights or the budget is spent; an interrupted call is no
        failure and is handed back as it is. A call that raised, or whose result is not
        handed back, produced no turn of the agent's, so running it again cannot record a
        turn twice."""
        aborted: GenerationResult | None = None  # handed back when a retry is refused
        while True:
            url, inner = await t.endpoint()
            self.base_url = url
            rid = t.next_rid()
            call = ModelCall(CallKind.GENERATE, url, inner, rid, resumable=True)
            try:
                result = await self._generate_call(
                    call, input_ids=input_ids, sampling_params=sampling_params
                )
            except Exception as exc:
                if not infra_failure(exc):
                    if aborted is not None:  # a hook refused the retry (the sample ended)
                        return aborted, False
                    raise
                t.shared.abort_later(inner, rid)  # the request may still run there
                if not budget.take(url, f"{type(exc).__name__}: {exc}"):
                    budget.reached_caller = True
                    raise
            else:
                if call.interrupted and result.aborted:
                    return result, True
                if result.aborted:
                    what = "the server aborted the generation"
                    aborted = result
                elif off := t.off_version(result):
                    what = off
                else:
                    return result, False
                if not budget.take(url, what):
                    budget.reached_caller = True
                    return result, False
            metrics.MODEL_RETRIES.labels("turn").inc()
            await asyncio.sleep(budget.pause_s())

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], *, top_logprobs_num: int = 0
    ) -> ForceDecodeScore:
        url, inner = await self._trajectory.endpoint()
        return await self._score(url, inner, prompt_ids, response_ids, top_logprobs_num)

    @asynccontextmanager
    async def forwarded_call(self) -> AsyncIterator[None]:
        url, inner = await self._trajectory.endpoint()
        try:
            async with self._forward(url, inner):
                yield
        except Exception:
            budget = self._trajectory.budget
            if budget is not None:  # the scaffold saw it: the attempt is re-run
                budget.reached_caller = True
            raise
