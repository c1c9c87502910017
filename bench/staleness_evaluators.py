"""Evaluator config of ``bench/staleness.py``: a multi-turn agent whose episode length is the
task's label.

``turns``: as many generate calls of ``TOKENS`` tokens as the task's label says (the bench
draws the labels from a Pareto law), through the worker's backend pool (so every call passes
the weight sync's gate and the sample's staleness guard), a short pause between them as a
tool call would take; the reward is the number of turns, so a group's statistics depend on
which of its episodes count. Each token carries the weight version its turn's reply reported.
"""

from __future__ import annotations

import asyncio

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason

TOKENS = 8
PAUSE_S = 0.02
PROMPT = (1, 310, 201, 40, 41, 42, 43, 2, 201, 1)
OBSERVATION = (201, 40, 41)


def episode_turns(task: Task) -> int:
    """The episode's length in turns: the task's label (at least one)."""
    label = task.label
    return max(1, int(label)) if isinstance(label, int | str) else 1


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
        for turn in range(episode_turns(task)):
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
        return float(len(result.turns))


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="turns",
            resource=Resource(concurrency=32),
            batch_size=4,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    return {"turns": TurnsAgent()}
