"""Hooks around the model calls of a ``BackendPool``'s backends, and the one wrapper that runs them.

A pool hands out each endpoint's backend wrapped in a ``HookedBackend``: every ``generate``,
every ``score`` and every ``forwarded_call`` span passes its hooks, so what must bracket a
model call (the worker's ``TurnGate``, an attempt's ``SampleGuard``) wraps any backend by
composition, whatever its class. The other operations of the port (``abort``,
``weight_version``, ``health``, ``tokenize``, ``decode``) go straight to the endpoint's backend.

A hook (``CallHook``) has two methods, run for each call in this order:

- ``await hook.before(call)``: may wait (a closed gate) or raise to refuse the call (a stale
  sample); it may set ``call.rid``, the request id the call is sent with. A call a hook
  refused reaches neither the server nor the hooks after it;
- ``hook.after(call, result, error)``: once for every ``before`` that returned, in reverse
  order, when the call ended: ``result`` is a ``generate``'s result (None for the other
  kinds), ``error`` what it raised (a refusal by a later hook and cancellation included). It
  must not raise.

``ModelCall`` names what the hooks see: the kind of call, the endpoint and its backend (the
server's own, to abort a request on or probe), the request id, and whether the caller can
continue the call's turn from its partial tokens (``resumable``: the worker's ``TurnGate`` may
then abort it for a weight sync and set ``interrupted``). A ``HookedBackend`` is cheap (an
object per ``get`` of a guarded view, one ``ModelCall`` per call) and owns nothing:
``aclose`` leaves the endpoint's backend to the pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from enum import StrEnum
from typing import Any, Protocol

from engine.backends.base import ForceDecodeScore, GenerationResult, ModelBackend

__all__ = ["CallHook", "CallKind", "HookedBackend", "ModelCall"]


class CallKind(StrEnum):
    GENERATE = "generate"
    SCORE = "score"
    FORWARD = "forward"  # a call the caller sent itself, inside ``forwarded_call``


class ModelCall:
    """One model call as its hooks see it (``rid`` may be set by a hook's ``before``)."""

    __slots__ = ("kind", "url", "backend", "rid", "resumable", "interrupted")

    def __init__(
        self,
        kind: CallKind,
        url: str,
        backend: ModelBackend,
        rid: str | None,
        *,
        resumable: bool = False,
    ) -> None:
        self.kind = kind
        self.url = url
        self.backend = backend
        self.rid = rid
        self.resumable = resumable
        self.interrupted = False  # aborted on purpose, for a weight sync (``TurnGate``)


class CallHook(Protocol):
    """Runs around each model call of a pool's backends (see the module docstring)."""

    async def before(self, call: ModelCall) -> None: ...

    def after(
        self, call: ModelCall, result: GenerationResult | None, error: BaseException | None
    ) -> None: ...


class HookedBackend(ModelBackend):
    """An endpoint's backend whose calls pass ``hooks`` (see the module docstring)."""

    def __init__(self, inner: ModelBackend, url: str, hooks: tuple[CallHook, ...]) -> None:
        self._inner = inner
        self._url = url
        self._hooks = hooks
        self.capabilities = inner.capabilities
        self.base_url = inner.base_url

    def __repr__(self) -> str:
        return repr(self._inner)

    async def generate(
        self,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        return await self._generate(
            self._url, self._inner, input_ids=input_ids, messages=messages, tools=tools,
            sampling_params=sampling_params, rid=rid,
        )  # fmt: skip

    async def _generate(
        self,
        url: str,
        inner: ModelBackend,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
        rid: str | None = None,
    ) -> GenerationResult:
        """One ``generate`` on endpoint ``url`` (its backend ``inner``) through the hooks."""
        call = ModelCall(CallKind.GENERATE, url, inner, rid)
        return await self._generate_call(
            call, input_ids=input_ids, messages=messages, tools=tools,
            sampling_params=sampling_params,
        )  # fmt: skip

    async def _generate_call(
        self,
        call: ModelCall,
        *,
        input_ids: Sequence[int] | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        sampling_params: Mapping[str, Any],
    ) -> GenerationResult:
        """``call`` (a ``generate``) through the hooks, on ``call.backend``."""
        inner = call.backend
        entered = await self._before(call)
        try:
            result = await inner.generate(
                input_ids=input_ids,
                messages=messages,
                tools=tools,
                sampling_params=sampling_params,
                rid=call.rid,
            )
        except BaseException as exc:
            self._after(call, entered, None, exc)
            raise
        self._after(call, entered, result, None)
        return result

    async def score(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], *, top_logprobs_num: int = 0
    ) -> ForceDecodeScore:
        return await self._score(self._url, self._inner, prompt_ids, response_ids, top_logprobs_num)

    async def _score(
        self,
        url: str,
        inner: ModelBackend,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
        top_logprobs_num: int,
    ) -> ForceDecodeScore:
        call = ModelCall(CallKind.SCORE, url, inner, None)
        entered = await self._before(call)
        try:
            score = await inner.score(prompt_ids, response_ids, top_logprobs_num=top_logprobs_num)
        except BaseException as exc:
            self._after(call, entered, None, exc)
            raise
        self._after(call, entered, None, None)
        return score

    def forwarded_call(self) -> AbstractAsyncContextManager[None]:
        return self._forward(self._url, self._inner)

    @asynccontextmanager
    async def _forward(self, url: str, inner: ModelBackend) -> AsyncIterator[None]:
        call = ModelCall(CallKind.FORWARD, url, inner, None)
        entered = await self._before(call)
        try:
            yield
        except BaseException as exc:
            self._after(call, entered, None, exc)
            raise
        self._after(call, entered, None, None)

    def hooks_for(self, call: ModelCall) -> tuple[CallHook, ...]:
        """The hooks ``call`` passes (a routed backend's depend on the endpoint)."""
        return self._hooks

    async def _before(self, call: ModelCall) -> int:
        """Run the hooks' ``before`` in order; how many returned."""
        entered = 0
        try:
            for hook in self.hooks_for(call):
                await hook.before(call)
                entered += 1
        except BaseException as exc:
            self._after(call, entered, None, exc)
            raise
        return entered

    def _after(
        self,
        call: ModelCall,
        entered: int,
        result: GenerationResult | None,
        error: BaseException | None,
    ) -> None:
        hooks = self.hooks_for(call)
        for i in range(entered - 1, -1, -1):
            hooks[i].after(call, result, error)

    async def abort(self, rid: str | None = None) -> None:
        await self._inner.abort(rid)

    async def weight_version(self) -> int | None:
        return await self._inner.weight_version()

    async def health(self, *, generate: bool = False) -> None:
        await self._inner.health(generate=generate)

    def tokenize(self, text: str) -> list[int]:
        return self._inner.tokenize(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._inner.decode(token_ids)

    async def aclose(self) -> None:
        """The pool owns the endpoint's backend and closes it."""
