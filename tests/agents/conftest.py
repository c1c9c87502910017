"""Fixtures for the tool-agent tests: a real tinylm model and server, a real local sandbox,
and a scripted ``/generate`` at the HTTP transport.

- ``model_dir``: ``tests/conftest.py``'s ``math_model_dir``, a tinylm overfit (60 steps) on
  ``MATH_EPISODE``, the math episode written exactly as the ``math`` agent renders it (system
  prompt, python tool), so greedy decoding reproduces it: a ``python`` call, then
  ``<answer>42</answer>``. Real tokenizer, chat template, logprobs.
- ``server``: that model served over real sockets (``start_server``, free port).
- ``provider``: a ``LocalSandboxProvider`` on a fresh root.

Both are package-scoped: their threads (uvicorn's, the sandbox supervisor's reader) stop when
the last agent test ends instead of running through every later test of the session.
- ``ScriptedGenerate``: an ``httpx.MockTransport`` handler answering ``/generate`` the way
  SGLang does, with replies scripted as text and tokenized by the real tokenizer (plus the
  end-of-turn token), distinct negative logprobs, the ``max_new_tokens`` cut honoured, and
  every request recorded. Agents reach it through a real ``SGLangBackend`` in a
  ``BackendPool`` (``script.backends``), the way they reach a worker's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.agents.base import AgentResult, EpisodeContext, Reward
from engine.agents.tool_agent import ToolAgent
from engine.backends.pool import BackendPool
from engine.backends.sglang import SGLangBackend, SGLangConfig, load_tokenizer
from engine.domain import SamplingParams, StoppingCriteria, Task
from engine.events.arrays import LogProbs
from engine.sandbox import LocalSandboxProvider, SandboxProvider
from tests.conftest import MATH_EPISODE, local_sandbox_provider
from tests.conftest import TINYLM_QUESTION as MATH_QUESTION
from tinylm.server import TinyLMServer, start_server

__all__ = ["MATH_EPISODE", "MATH_QUESTION"]  # the agent and lane tests import them from here


@pytest.fixture(scope="session")
def model_dir(math_model_dir: Path) -> Path:
    return math_model_dir


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Any:
    return load_tokenizer(model_dir)


@pytest.fixture(scope="package")  # stopped when the agent tests end, not at session end
def server(model_dir: Path) -> Iterator[TinyLMServer]:
    with start_server(model_dir, max_running_requests=4) as srv:
        yield srv


@pytest.fixture(scope="package")
def provider() -> Iterator[LocalSandboxProvider]:
    with local_sandbox_provider("rollout-agent-tests-") as prov:
        yield prov


def make_task(
    prompt: str = MATH_QUESTION, label: str = "42", task_type: str = "math", index: int = 0
) -> Task:
    return Task(
        sample_id=f"r1:s{index}",
        rollout_id="r1",
        index=index,
        group_index=index,
        prompt=prompt,
        label=label,
        dataset_name=f"{task_type}_test",
        task_type=task_type,
        source_line=index + 1,
    )


def make_context(
    task: Task,
    *,
    sandboxes: SandboxProvider | None,
    backends: BackendPool | None,
    tmp_path: Path,
    max_turns: int = 4,
    max_context_len: int = 1024,
    max_new_tokens: int = 96,
    sampling: SamplingParams | None = None,
    attempt: int = 1,
) -> EpisodeContext:
    return EpisodeContext(
        rollout_id=task.rollout_id,
        sample_id=task.sample_id,
        attempt=attempt,
        stopping=StoppingCriteria(
            max_turns=max_turns, max_context_len=max_context_len, max_new_tokens=max_new_tokens
        ),
        sampling_params=sampling or SamplingParams(temperature=0.0),
        tmp_dir=tmp_path / f"{task.sample_id}-a{attempt}",
        backends=backends,
        sandboxes=sandboxes,
    )


async def run_episode(
    agent: ToolAgent, task: Task, context: EpisodeContext
) -> tuple[AgentResult, Reward]:
    """One episode of ``agent``: init -> run -> eval -> cleanup, as the evaluator drives them."""
    episode = agent.episode(task)
    await episode.init(context)
    try:
        result = await episode.run(context)
        reward = await episode.eval(context, result)
    finally:
        await episode.cleanup(context)
    return result, reward


@dataclass(frozen=True)
class Reply:
    """One scripted generation: ``text`` tokenized, then the end-of-turn token if ``eos``."""

    text: str
    eos: bool = True
    finish: str | None = None  # force a finish type, e.g. "abort"
    version: str | None = None  # the meta_info.weight_version reported (None: none)


@dataclass
class ScriptedGenerate:
    """SGLang's ``/generate`` answered from a script (see the module docstring)."""

    tokenizer: Any
    replies: Sequence[Reply]
    requests: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    backends: BackendPool = field(init=False)

    def __post_init__(self) -> None:
        self.backends = BackendPool("http://scripted.invalid", build=self.backend_factory)

    def handle(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/generate", request.url
        body = json.loads(request.content)
        self.requests.append(body)
        turn = len(self.requests) - 1
        if turn >= len(self.replies):
            return httpx.Response(500, json={"message": f"script has no reply {turn}"})
        reply = self.replies[turn]
        ids = list(self.tokenizer(reply.text, add_special_tokens=False)["input_ids"])
        eos = int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        if reply.eos:
            ids.append(eos)
        budget = int(body["sampling_params"]["max_new_tokens"])
        finish: dict[str, Any] = {"type": "stop", "matched": eos}
        if len(ids) > budget:
            ids = ids[:budget]
            finish = {"type": "length", "length": budget}
        elif not reply.eos:
            finish = {"type": "length", "length": len(ids)}
        if reply.finish == "abort":
            finish = {"type": "abort", "message": "scripted abort"}
        logprobs = [-(0.5 + 0.01 * (turn * 100 + i)) for i in range(len(ids))]
        self.outputs.append((ids, logprobs))
        kept = ids[:-1] if finish["type"] == "stop" else ids
        return httpx.Response(
            200,
            json={
                "text": self.tokenizer.decode(kept, skip_special_tokens=True),
                "output_ids": ids,
                "meta_info": {
                    "id": f"req-{turn}",
                    "finish_reason": finish,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(ids),
                    "output_token_logprobs": [
                        [lp, tid, None] for lp, tid in zip(logprobs, ids, strict=True)
                    ],
                    **({} if reply.version is None else {"weight_version": reply.version}),
                },
            },
        )

    def backend_factory(self, url: str) -> SGLangBackend:
        return SGLangBackend(
            config=SGLangConfig(url=url),
            tokenizer=self.tokenizer,
            transport=httpx.MockTransport(self.handle),
        )


def check_trajectory(
    result: AgentResult, generated: Sequence[tuple[list[int], list[float]]]
) -> None:
    """The token invariants every trajectory keeps, against what the server returned.

    ``generated`` lists each turn's (token ids, logprobs) as the server sent them, in order.
    """
    n = len(result.response_token_ids)
    assert len(result.loss_mask) == n and len(result.response_logprobs) == n
    # Split the response into runs of generated (mask 1) and observed (mask 0) tokens.
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or result.loss_mask[i] != result.loss_mask[start]:
            runs.append((result.loss_mask[start], start, i))
            start = i
    gen_runs = [(s, e) for bit, s, e in runs if bit == 1]
    assert len(gen_runs) == len(generated), (runs, [len(g[0]) for g in generated])
    for (s, e), (ids, logprobs) in zip(gen_runs, generated, strict=True):
        assert list(result.response_token_ids[s:e]) == ids
        # packed as float32, the precision the log keeps (SGLang's own)
        assert result.response_logprobs[s:e] == LogProbs.from_values(logprobs)
    for bit, s, e in runs:
        if bit == 0:
            assert set(result.response_logprobs[s:e]) == {0.0}
    assert sum(result.loss_mask) == sum(len(ids) for ids, _ in generated)
    assert result.metrics["response_tokens"] == n
    assert result.metrics["generated_tokens"] == sum(result.loss_mask)
    assert sum(t.response_tokens for t in result.turns) == sum(result.loss_mask)
    # Each turn's prompt is everything before its generation.
    for turn, (s, _e) in zip(result.turns, gen_runs, strict=True):
        assert turn.prompt_tokens == len(result.prompt_token_ids) + s
