"""Evaluator config of ``bench/rollout.py``: one zero-latency agent, so the bench measures the
engine (events, Redis, scheduling, finalizing) and nothing else.

``fast``: one turn, 16 response tokens with logprobs, reward 1. Batches of 256 samples; a
batch may run all of its samples at once. ``BENCH_AGENT_LATENCY_MS`` (default 0) makes each
episode's ``run`` sleep that long first (``bench/peers.py``'s 50 ms agent).
"""

from __future__ import annotations

import asyncio
import os

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason

BATCH_SIZE = 256
RESPONSE_TOKENS = 16


class ZeroLatencyAgent(BaseAgent):
    """Answers at once with a fixed-size trajectory derived from the task index."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        base = task.index % 1000
        return AgentResult(
            prompt_token_ids=(1, 2, 3, 4, 5, 6, 7, base),
            response_token_ids=tuple(base + i for i in range(RESPONSE_TOKENS)),
            response_logprobs=(-0.5,) * RESPONSE_TOKENS,
            loss_mask=(1,) * RESPONSE_TOKENS,
            turns=(TurnRecord(index=0, prompt_tokens=8, response_tokens=RESPONSE_TOKENS),),
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
    latency_ms = float(os.environ.get("BENCH_AGENT_LATENCY_MS", "0"))
    return {"fast": ZeroLatencyAgent(latency_ms / 1000)}
