"""A ``BackendPool``'s hooks wrap any backend by composition: the worker's gate and an
attempt's guard apply to a chat backend (``OpenAIBackend``, faked at its transport) exactly as
they do to SGLang's, and the capabilities callers ask come through the pool's wrapper."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from engine.actors.outcomes import ReportedAbort
from engine.actors.sample_guard import SampleGuard
from engine.backends import (
    BackendPool,
    CallKind,
    Capabilities,
    GenerationResult,
    ModelCall,
    OpenAIBackend,
    OpenAIConfig,
)
from engine.errors import BackendHTTPError
from engine.events import PolicyVersionPublished, RolloutRequested
from engine.outcomes import TerminationReason
from tests.rig import control_with

URL = "http://api.test/v1"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
PARAMS = {"max_new_tokens": 4}


class ChatServer:
    """The chat API's transport: answers each request, or fails it with ``status``, and
    records what the worker's gate counted while the request was on the wire."""

    def __init__(self, pool: BackendPool | None = None) -> None:
        self.pool = pool
        self.bodies: list[dict[str, Any]] = []
        self.in_flight: list[int] = []
        self.status = 200

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        if self.pool is not None:
            self.in_flight.append(self.pool.gate.in_flight)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": "down"})
        return httpx.Response(200, json={
            "choices": [{"message": {"role": "assistant", "content": "4"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 1},
        })  # fmt: skip


def chat_pool(server: ChatServer, urls: str = URL, **kw: Any) -> BackendPool:
    def build(url: str) -> OpenAIBackend:
        config = OpenAIConfig(base_url=url, model="m", status_retry=None)
        return OpenAIBackend(config=config, transport=httpx.MockTransport(server))

    pool = BackendPool(urls, build=build, **kw)
    server.pool = pool
    return pool


class Recorder:
    """A hook that records what it sees, and refuses calls while ``refuse`` is set."""

    def __init__(self, name: str, seen: list[tuple[str, str, str]]) -> None:
        self.name = name
        self.seen = seen
        self.refuse = False

    async def before(self, call: ModelCall) -> None:
        self.seen.append((self.name, "before", call.kind))
        if self.refuse:
            raise RuntimeError(f"{self.name} refuses")

    def after(
        self, call: ModelCall, result: GenerationResult | None, error: BaseException | None
    ) -> None:
        what = "result" if result is not None else type(error).__name__ if error else "none"
        self.seen.append((self.name, "after", what))


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_the_gate_holds_a_chat_backends_calls_and_counts_them_in_flight() -> None:
    server = ChatServer()
    async with chat_pool(server) as pool:
        backend = pool.bind("trajectory").get()
        assert backend.capabilities == Capabilities() and backend.base_url == URL
        pool.gate.close("sync")
        call = asyncio.create_task(backend.generate(messages=MESSAGES, sampling_params=PARAMS))
        await settle()
        assert not call.done() and server.bodies == [] and pool.gate.in_flight == 0
        pool.gate.open()
        result = await call
        assert result.text == "4" and server.in_flight == [1] and pool.gate.in_flight == 0
        server.status = 500  # a failed call leaves the gate drained too
        with pytest.raises(BackendHTTPError):
            await backend.generate(messages=MESSAGES, sampling_params=PARAMS)
        assert server.in_flight == [1, 1] and pool.gate.in_flight == 0
        await asyncio.wait_for(pool.gate.drained(), 1)


def _stale_guard() -> SampleGuard:
    request = RolloutRequested.model_validate(
        {"rollout_id": "r", "n_prompts": 2, "n_samples_per_prompt": 2, "max_staleness": 1}
    )
    return SampleGuard(request, control_with(PolicyVersionPublished(version=3)), "r", "r:s0", 1)


async def test_an_attempts_guard_checks_and_records_every_turn_of_a_chat_backend() -> None:
    server = ChatServer()
    guard = _stale_guard()
    async with chat_pool(server) as pool:
        backend = pool.bind("r/r:s0/1", hooks=(guard,)).get()
        first = await backend.generate(messages=MESSAGES, sampling_params=PARAMS)
        # The chat API names no weight version: an unknown version never meets the bound.
        assert first.weight_version is None and (guard.turns, guard.oldest) == (1, -1)
        assert guard.in_flight == {}  # the chat backend cannot abort by rid
        with pytest.raises(ReportedAbort) as refused:
            await backend.generate(messages=MESSAGES, sampling_params=PARAMS)
        assert refused.value.reason is TerminationReason.STALE and guard.ended is not None
        assert len(server.bodies) == 1 and pool.gate.in_flight == 0  # it reached no server
        # The pool's own backend, and another endpoint from the view, are not guarded.
        await pool.get().generate(messages=MESSAGES, sampling_params=PARAMS)
        await pool.bind("r/r:s0/1", hooks=(guard,)).get("http://judge.test/v1").generate(
            messages=MESSAGES, sampling_params=PARAMS
        )
        assert len(server.bodies) == 3 and guard.turns == 1


async def test_hooks_run_in_order_and_each_entered_one_hears_how_the_call_ended() -> None:
    seen: list[tuple[str, str, str]] = []
    outer, inner = Recorder("view", seen), Recorder("pool", seen)
    server = ChatServer()
    async with chat_pool(server, hooks=(inner,)) as pool:
        backend = pool.bind("k", hooks=(outer,)).get()
        await backend.generate(messages=MESSAGES, sampling_params=PARAMS)
        assert seen == [
            ("view", "before", "generate"), ("pool", "before", "generate"),
            ("pool", "after", "result"), ("view", "after", "result"),
        ]  # fmt: skip
        seen.clear()
        inner.refuse = True  # the view's hook entered, the pool's refused: no request
        with pytest.raises(RuntimeError, match="pool refuses"):
            await backend.generate(messages=MESSAGES, sampling_params=PARAMS)
        assert seen == [
            ("view", "before", "generate"), ("pool", "before", "generate"),
            ("view", "after", "RuntimeError"),
        ]  # fmt: skip
        assert len(server.bodies) == 1 and pool.gate.in_flight == 0
        inner.refuse = False
        seen.clear()
        async with backend.forwarded_call():  # a pass-through: the same hooks
            assert pool.gate.in_flight == 1
        assert [kind for _, step, kind in seen if step == "before"] == [CallKind.FORWARD] * 2
        seen.clear()
        with pytest.raises(NotImplementedError, match="has no scoring capability"):
            await backend.score([1, 2], [3])
        assert ("pool", "after", "NotImplementedError") in seen and pool.gate.in_flight == 0


async def test_a_view_names_each_generation_and_the_guard_keeps_those_in_flight() -> None:
    guard = _stale_guard()
    guard.request = None  # no bound: every turn may run

    class Aborting:
        capabilities = Capabilities(token_ids=True, abort=True)

    view = BackendPool("http://policy:1").bind("r:s0/a1", hooks=(guard,))
    trajectory = view._trajectory
    assert trajectory is not None
    rids = [trajectory.next_rid() for _ in range(3)]
    assert rids == ["r:s0/a1/t0", "r:s0/a1/t1", "r:s0/a1/t2"]  # one per call, retries too
    call = ModelCall(CallKind.GENERATE, "http://policy:1", Aborting(), rids[0])  # type: ignore[arg-type]
    await guard.before(call)
    assert guard.in_flight == {"r:s0/a1/t0": call.backend}  # aborted by this exact rid
    guard.after(call, GenerationResult(text="", token_ids=(1,), logprobs=(-0.5,),
                                       weight_version=4), None)  # fmt: skip
    assert guard.in_flight == {} and guard.oldest == 4 and guard.turns == 1
    rescore = ModelCall(CallKind.SCORE, "http://policy:1", call.backend, None)
    await guard.before(rescore)
    guard.after(rescore, None, None)
    assert rescore.rid is None and guard.turns == 1  # a re-score is no turn
