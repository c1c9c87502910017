"""The model-server fault suite's agent and evaluator config: ``TURNS`` streamed policy
generations of ``TOKENS`` tokens per sample on the worker's policy servers (the pool), an
observation token between them; the reward is the sample's parity.

With ``SERVER_FAULTS_RECORD`` set, each turn appends one line (a single ``O_APPEND`` write)
to that file once its generation returned:

    {"sid": ..., "attempt": n, "turn": t, "url": server, "version": v, "t0": wall, "t1": wall}

``url`` is the server that served the turn (the routed backend's ``base_url`` after the call)
and ``version`` the weight version it reported, so which server at which version served each
turn is *observed*, whatever the worker retried inside the call.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import EvaluatorProfile, Resource, Task, TerminationReason

EVALUATOR = "policy"
BATCH_SIZE = 8
TURNS = 3
TOKENS = 16
RECORD_ENV = "SERVER_FAULTS_RECORD"


def _record(line: dict[str, object]) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


@dataclass
class PolicyTurns(BaseAgent):
    """See the module docstring; ``turns`` and ``tokens`` default to ``TURNS`` and
    ``TOKENS``."""

    turns: int = TURNS
    tokens: int = TOKENS

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        assert context.backends is not None, "the worker has no policy servers"
        backend = context.backends.get()
        prompt = [1 + task.group_index % 7, 2, 3]
        response: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        versions: list[int] = []
        turns: list[TurnRecord] = []
        for t in range(self.turns):
            t0 = time.time()
            gen = await backend.generate(
                input_ids=prompt + response,
                sampling_params={"max_new_tokens": self.tokens, "temperature": 1.0,
                                 "ignore_eos": True},
            )  # fmt: skip
            if gen.token_ids is None or gen.logprobs is None or gen.aborted:
                raise RuntimeError(f"{task.sample_id}: turn {t} returned no tokens: {gen}")
            _record({"sid": task.sample_id, "attempt": context.attempt, "turn": t,
                     "url": backend.base_url, "version": gen.weight_version, "t0": t0,
                     "t1": time.time()})  # fmt: skip
            n = len(gen.token_ids)
            response += [*gen.token_ids, 4]
            logprobs += [*gen.logprobs, 0.0]
            mask += [1] * n + [0]
            version = gen.weight_version if gen.weight_version is not None else -1
            versions += [version] * n + [-1]
            turns.append(TurnRecord(index=t, prompt_tokens=len(prompt) + len(response),
                                    response_tokens=n, weight_version=gen.weight_version))
        return AgentResult(
            prompt_token_ids=prompt,
            response_token_ids=response,
            response_logprobs=logprobs,
            loss_mask=mask,
            response_versions=versions,
            turns=tuple(turns),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return float(task.index % 2)


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [EvaluatorProfile(evaluator_id=EVALUATOR, resource=Resource(concurrency=BATCH_SIZE),
                             batch_size=BATCH_SIZE)]  # fmt: skip


def build_agents(args: object) -> dict[str, BaseAgent]:
    return {EVALUATOR: PolicyTurns()}
