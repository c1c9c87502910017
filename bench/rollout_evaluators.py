"""Evaluator config of ``bench/rollout.py``: one zero-latency agent, so the bench measures the
engine (events, Redis, scheduling, finalizing) and nothing else.

``fast``: one turn, 16 response tokens with logprobs after an 8-token prompt that the
samples of a group share, reward 1. Batches of 256 samples; a batch may run all of its
samples at once. ``BENCH_AGENT_LATENCY_MS`` (default 0) makes each episode's ``run`` sleep
that long first (``bench/peers.py``'s 50 ms agent); ``BENCH_PROMPT_TOKENS`` and
``BENCH_RESPONSE_TOKENS`` set the lengths (``bench/memory.py --prompt-tokens
--response-tokens``) and ``BENCH_TOKEN_OFFSET`` (default 0) is added to the response token
ids (``--token-offset``: ids of a large vocabulary).
"""

from __future__ import annotations

import asyncio
import os

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason

BATCH_SIZE = 256
RESPONSE_TOKENS = 16
PROMPT_TOKENS = 8


class ZeroLatencyAgent(BaseAgent):
    """Answers at once with a fixed-size trajectory derived from the task index."""

    def __init__(
        self,
        latency_s: float = 0.0,
        prompt_tokens: int = PROMPT_TOKENS,
        response_tokens: int = RESPONSE_TOKENS,
        token_offset: int = 0,
    ) -> None:
        self.latency_s = latency_s
        self.token_offset = token_offset
        self.prompt_tokens = prompt_tokens
        self.response_tokens = response_tokens

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        base = task.index % 1000
        group = task.group_index % 1000  # a group's samples share their prompt
        n_prompt, n_response = self.prompt_tokens, self.response_tokens
        return AgentResult(
            prompt_token_ids=(*range(1, n_prompt), group),
            response_token_ids=tuple(self.token_offset + base + i for i in range(n_response)),
            response_logprobs=(-0.5,) * n_response,
            loss_mask=(1,) * n_response,
            turns=(TurnRecord(index=0, prompt_tokens=n_prompt, response_tokens=n_response),),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="fast",
            resource=Resource(concurrency=BATCH_SIZE, cpu=float(BATCH_SIZE)),
            run_resource=Resource(cpu=1.0),
            eval_resource=Resource(cpu=1.0),
            batch_size=BATCH_SIZE,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    env = os.environ
    return {
        "fast": ZeroLatencyAgent(
            float(env.get("BENCH_AGENT_LATENCY_MS", "0")) / 1000,
            int(env.get("BENCH_PROMPT_TOKENS", PROMPT_TOKENS)),
            int(env.get("BENCH_RESPONSE_TOKENS", RESPONSE_TOKENS)),
            int(env.get("BENCH_TOKEN_OFFSET", "0")),
        )
    }
