"""One ``ToolAgent`` serves concurrent episodes: each keeps its own sandbox and trajectory, and
all of them generate through the worker's one backend.

Two episodes of one agent run at once against a scripted ``/generate`` (real tokenizer, real
``SGLangBackend`` in one ``BackendPool``) and the real local sandbox. The transport holds every
request of a turn until both episodes have sent theirs, so the episodes are inside ``run``
together, turn after turn; a test that passed with them taking turns would prove nothing.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.agents.tool_agent import ToolAgent
from engine.backends.base import ModelBackend
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.backends.toolcalls import render_tool_call
from engine.domain import Task, TerminationReason
from engine.errors import AgentError
from engine.sandbox import LocalSandboxProvider
from engine.tasks.evaluators import math_agent_config
from engine.tasks.math import MathVerifier
from tests.agents.conftest import (
    Reply,
    ScriptedGenerate,
    check_trajectory,
    make_context,
    make_task,
    run_episode,
)

URL = "http://scripted.invalid"


def python_call(code: str) -> str:
    return render_tool_call("python", {"code": code})


def episode_script(tokenizer: Any, word: str, expression: str, answer: str) -> ScriptedGenerate:
    """Write ``word`` to a file in the sandbox and compute, read the file back, answer."""
    return ScriptedGenerate(
        tokenizer,
        [
            Reply(python_call(f"open('mine.txt', 'w').write('{word}')\nprint({expression})")),
            Reply(python_call("print(open('mine.txt').read())")),
            Reply(f"The answer is <answer>{answer}</answer>"),
        ],
    )


def observed(result: Any, tokenizer: Any) -> str:
    """What the episode's tool calls printed: its loss-mask-0 tokens, decoded."""
    ids = [t for t, m in zip(result.response_token_ids, result.loss_mask, strict=True) if m == 0]
    return str(tokenizer.decode(ids))


class LockstepRoute:
    """Routes each ``/generate`` to the script of the episode whose prompt it extends, and
    answers turn ``t`` only once every episode has sent its turn ``t``."""

    def __init__(self, routes: list[tuple[list[int], ScriptedGenerate]]) -> None:
        self.routes = routes
        self.arrived: dict[int, int] = {}
        self.all_in: dict[int, asyncio.Event] = {}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        ids = json.loads(request.content)["input_ids"]
        [script] = [s for prompt, s in self.routes if ids[: len(prompt)] == prompt]
        turn = len(script.requests)
        self.arrived[turn] = self.arrived.get(turn, 0) + 1
        event = self.all_in.setdefault(turn, asyncio.Event())
        if self.arrived[turn] == len(self.routes):
            event.set()
        async with asyncio.timeout(20):  # the other episode never got here: not concurrent
            await event.wait()
        return script.handle(request)


async def test_two_concurrent_episodes_on_one_agent_do_not_interfere(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    agent = ToolAgent(math_agent_config(), verifier=MathVerifier(), tokenizer=tokenizer)
    alpha = make_task("What is 17 + 25?", "42", index=0)
    beta = make_task("What is 9 * 11?", "99", index=1)
    scripts = {
        alpha.sample_id: episode_script(tokenizer, "alpha", "17 + 25", "42"),
        beta.sample_id: episode_script(tokenizer, "beta", "9 * 11", "99"),
    }
    route = LockstepRoute(
        [
            (agent.chat.prompt_ids(agent.initial_messages(task)), scripts[task.sample_id])
            for task in (alpha, beta)
        ]
    )
    built: list[str] = []

    def build(url: str) -> ModelBackend:
        built.append(url)
        return SGLangBackend(
            config=SGLangConfig(url=url), transport=httpx.MockTransport(route.handle)
        )

    async with BackendPool(URL, build=build) as backends:

        async def one(task: Task) -> Any:
            ctx = make_context(task, sandboxes=provider, backends=backends, tmp_path=tmp_path)
            return await run_episode(agent, task, ctx)

        (result_a, reward_a), (result_b, reward_b) = await asyncio.gather(one(alpha), one(beta))

    assert built == [URL]  # both episodes generated through the worker's one backend
    assert route.arrived == {0: 2, 1: 2, 2: 2}
    for result, reward, task in ((result_a, reward_a, alpha), (result_b, reward_b, beta)):
        assert result.termination_reason is TerminationReason.FINISH
        assert isinstance(reward, dict) and reward["score"] == 1.0
        assert [t.tool_calls for t in result.turns] == [("python",), ("python",), ()]
        check_trajectory(result, scripts[task.sample_id].outputs)
        assert await provider.find({"rollout.sample": task.sample_id}) == []
    # Each episode read back what it wrote in its own sandbox, never the other's.
    seen_a, seen_b = (observed(r, tokenizer) for r in (result_a, result_b))
    assert "\n42\n" in seen_a and "\nalpha\n" in seen_a and "beta" not in seen_a
    assert "\n99\n" in seen_b and "\nbeta\n" in seen_b and "alpha" not in seen_b


async def test_phases_run_on_the_episode_not_on_the_agent(
    tokenizer: Any, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    script = ScriptedGenerate(tokenizer, [])
    agent = ToolAgent(math_agent_config(), verifier=MathVerifier(), tokenizer=tokenizer)
    task = make_task()
    ctx = make_context(task, sandboxes=provider, backends=script.backends, tmp_path=tmp_path)
    with pytest.raises(AgentError, match=r"agent\.episode\(task\)\.init"):
        await agent.init(task, ctx)
    assert await provider.find({"rollout.sample": task.sample_id}) == []
    episode = agent.episode(task)
    await episode.init(ctx)
    with pytest.raises(AgentError, match="already started"):
        await episode.init(ctx)
    await episode.cleanup(ctx)
    assert await provider.find({"rollout.sample": task.sample_id}) == []
