"""The tool agent against a real tinylm server over real sockets and the real local sandbox.

The model is overfit on one math episode (see ``conftest.py``), so greedy decoding calls
``python`` with ``print(17 + 25)``, reads ``42`` back and answers ``<answer>42</answer>``. Every
reply the server sent is recorded at the transport, so the trajectory's tokens and logprobs are
checked against exactly what the server returned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from engine.agents.base import AgentResult, EpisodeContext, Reward
from engine.agents.tool_agent import ToolAgent, ToolAgentConfig
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig
from engine.domain import SamplingParams, Task, TerminationReason
from engine.sandbox import LocalSandboxProvider
from engine.tasks.evaluators import math_agent_config
from engine.tasks.math import MathVerifier
from tests.agents.conftest import check_trajectory, make_context, make_task, run_episode
from tinylm.server import TinyLMServer


class RecordingTransport(httpx.AsyncBaseTransport):
    """A real HTTP transport that keeps every ``/generate`` reply body."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._replies = replies

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        body = await response.aread()
        if request.url.path == "/generate":
            self._replies.append(json.loads(body))
        return httpx.Response(response.status_code, headers=response.headers, content=body)

    async def aclose(self) -> None:
        await self._inner.aclose()


class Harness:
    """The math agent and a backend pool on the server whose replies are recorded."""

    def __init__(self, tokenizer: Any, server_url: str, **overrides: Any) -> None:
        self.replies: list[dict[str, Any]] = []
        config = math_agent_config()
        fields = {name: getattr(config, name) for name in ToolAgentConfig.__dataclass_fields__}
        fields.update(**overrides)
        self.agent = ToolAgent(
            ToolAgentConfig(**fields), verifier=MathVerifier(), tokenizer=tokenizer
        )
        self.tokenizer = tokenizer
        self.backends = BackendPool(server_url, build=self.backend)

    async def run(self, task: Task, context: EpisodeContext) -> tuple[AgentResult, Reward]:
        """One episode, then the pool is closed (as the worker closes it when it stops)."""
        try:
            return await run_episode(self.agent, task, context)
        finally:
            await self.backends.aclose()

    def backend(self, url: str) -> SGLangBackend:
        return SGLangBackend(
            config=SGLangConfig(url=url),
            tokenizer=self.tokenizer,
            transport=RecordingTransport(self.replies),
        )

    def generated(self) -> list[tuple[list[int], list[float]]]:
        out = []
        for reply in self.replies:
            pairs = reply["meta_info"]["output_token_logprobs"]
            assert [tid for _, tid, _ in pairs] == reply["output_ids"]
            out.append((reply["output_ids"], [lp for lp, _, _ in pairs]))
        return out


def prompt_length(harness: Harness) -> int:
    task = make_task()
    return len(harness.agent.chat.prompt_ids(harness.agent.initial_messages(task)))


async def test_math_episode_end_to_end(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    harness = Harness(tokenizer, server.url)
    task = make_task()
    ctx = make_context(task, sandboxes=provider, tmp_path=tmp_path, backends=harness.backends)
    result, reward = await harness.run(task, ctx)

    assert result.termination_reason is TerminationReason.FINISH
    assert isinstance(reward, dict) and reward["score"] == 1.0
    assert [t.tool_calls for t in result.turns] == [("python",), ()]
    assert [t.finish_reason for t in result.turns] == ["stop", "stop"]
    assert result.metrics["n_tool_calls"] == 1 and result.metrics["n_tool_errors"] == 0
    check_trajectory(result, harness.generated())

    # The prompt is the chat template's rendering; each request carried the whole series.
    messages = harness.agent.initial_messages(task)
    tools = [t.schema() for t in harness.agent.config.tools]
    rendered = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert (
        list(result.prompt_token_ids) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )
    assert [r["meta_info"]["prompt_tokens"] for r in harness.replies] == [
        t.prompt_tokens for t in result.turns
    ]

    # Detokenized, the series is the conversation re-rendered with the model's own text.
    first, second = (
        tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in harness.generated()
    )
    assert "<tool_call>" in first and "<answer>42</answer>" in second
    full = tokenizer.apply_chat_template(
        [
            *messages,
            {"role": "assistant", "content": first},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": second},
        ],
        tools=tools,
        tokenize=False,
    )
    series = tokenizer.decode(
        [*result.prompt_token_ids, *result.response_token_ids], skip_special_tokens=False
    )
    assert series + "\n" == full
    # The observation tokens are exactly the template's text for them, tokenized.
    observed = [
        t for t, m in zip(result.response_token_ids, result.loss_mask, strict=True) if m == 0
    ]
    expected_text = (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert observed == tokenizer(expected_text, add_special_tokens=False)["input_ids"]


async def test_max_turns_stops_before_running_the_tool(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    harness = Harness(tokenizer, server.url)
    task = make_task()
    ctx = make_context(
        task, sandboxes=provider, tmp_path=tmp_path, backends=harness.backends, max_turns=1
    )
    result, reward = await harness.run(task, ctx)
    assert result.termination_reason is TerminationReason.MAX_TURNS
    assert len(result.turns) == 1 and result.turns[0].tool_calls == ("python",)
    assert result.metrics["n_tool_calls"] == 0
    assert set(result.loss_mask) == {1}
    check_trajectory(result, harness.generated())
    assert isinstance(reward, dict) and reward["score"] == 0.0


async def test_per_turn_cap_is_length(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    harness = Harness(tokenizer, server.url)
    task = make_task()
    ctx = make_context(
        task, sandboxes=provider, tmp_path=tmp_path, backends=harness.backends, max_new_tokens=5
    )
    result, _ = await harness.run(task, ctx)
    assert result.termination_reason is TerminationReason.LENGTH
    assert [t.finish_reason for t in result.turns] == ["length"]
    assert len(result.response_token_ids) == 5
    check_trajectory(result, harness.generated())


async def test_context_exhausted_during_generation_is_max_context(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    harness = Harness(tokenizer, server.url)
    task = make_task()
    limit = prompt_length(harness) + 7
    ctx = make_context(
        task,
        sandboxes=provider,
        tmp_path=tmp_path,
        backends=harness.backends,
        max_context_len=limit,
    )
    result, _ = await harness.run(task, ctx)
    assert result.termination_reason is TerminationReason.MAX_CONTEXT
    assert harness.replies[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(result.prompt_token_ids) + len(result.response_token_ids) == limit
    check_trajectory(result, harness.generated())


async def test_observation_that_does_not_fit_is_max_context(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    probe = Harness(tokenizer, server.url)
    task = make_task()
    first, _ = await probe.run(
        task,
        make_context(
            task, sandboxes=provider, tmp_path=tmp_path, backends=probe.backends, max_turns=1
        ),
    )
    call_len = len(first.response_token_ids)

    harness = Harness(tokenizer, server.url)
    limit = len(first.prompt_token_ids) + call_len + 3  # the call fits, its observation not
    ctx = make_context(
        task,
        sandboxes=provider,
        tmp_path=tmp_path,
        backends=harness.backends,
        max_context_len=limit,
        attempt=2,
    )
    result, _ = await harness.run(task, ctx)
    assert result.termination_reason is TerminationReason.MAX_CONTEXT
    assert result.response_token_ids == first.response_token_ids
    assert set(result.loss_mask) == {1}
    assert result.metrics["n_tool_calls"] == 1  # the call ran; its output had no room
    check_trajectory(result, harness.generated())


async def test_seeded_sampling_reproduces_an_episode(
    tokenizer: Any, server: TinyLMServer, provider: LocalSandboxProvider, tmp_path: Path
) -> None:
    task = make_task()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, sampling_seed=1234)
    results: list[AgentResult] = []
    for attempt in (1, 2):
        harness = Harness(tokenizer, server.url)
        ctx = make_context(
            task,
            sandboxes=provider,
            tmp_path=tmp_path,
            backends=harness.backends,
            sampling=sampling,
            attempt=attempt,
        )
        result, _ = await harness.run(task, ctx)
        check_trajectory(result, harness.generated())
        results.append(result)
    assert results[0].response_token_ids == results[1].response_token_ids
    assert results[0].response_logprobs == results[1].response_logprobs
