"""Evaluator config of ``bench/async_refill.py``: a multi-turn agent on the policy server.

``turns``: ``TURNS`` generate calls of ``TOKENS`` tokens each through the worker's backend
pool (so every call passes the weight sync's gate), a short pause between them as a tool call
would take, reward 1. Each token carries the weight version its turn's reply reported.
"""

from __future__ import annotations

import asyncio

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason

TURNS = 3
TOKENS = 16
PAUSE_S = 0.05
PROMPT = (1, 310, 201, 40, 41, 42, 43, 2, 201, 1)
OBSERVATION = (201, 40, 41)


class TurnsAgent(BaseAgent):
    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if context.backends is None:
            raise RuntimeError("the bench agent needs the worker's model backend")
        backend = context.backends.get()
        prompt = [*PROMPT, 90 + task.index % 50]
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns: list[TurnRecord] = []
        params = {
            "max_new_tokens": TOKENS, "temperature": 1.0,
            "sampling_seed": context.seed, "ignore_eos": True,
        }
        for turn in range(TURNS):
            gen = await backend.generate(input_ids=prompt + response, sampling_params=params)
            ids, lps = gen.token_ids or (), gen.logprobs or ()
            version = -1 if gen.weight_version is None else gen.weight_version
            response += [*ids, *OBSERVATION]
            logprobs += [*lps, *([0.0] * len(OBSERVATION))]
            mask += [1] * len(ids) + [0] * len(OBSERVATION)
            versions += [version] * len(ids) + [-1] * len(OBSERVATION)
            turns.append(TurnRecord(index=turn, prompt_tokens=len(prompt), response_tokens=len(ids),
                                    weight_version=gen.weight_version))
            await asyncio.sleep(PAUSE_S)
        return AgentResult(
            prompt_token_ids=prompt, response_token_ids=response, response_logprobs=logprobs,
            loss_mask=mask, response_versions=versions, turns=tuple(turns),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="turns",
            resource=Resource(concurrency=16),
            batch_size=4,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    return {"turns": TurnsAgent()}
