"""The fault suite's agent: it records, in a file, when each attempt runs and on which node.

Over-commit and repeated runs are then *observed* (what ran, where, when) rather than
inferred from the log. Every record is one line appended with a single ``write`` to the
file named by ``FAULTS_RECORD`` (``O_APPEND``: lines of concurrent processes never mix):

    {"ev": "start" | "end", "sid": ..., "attempt": n, "node": ..., "pid": ..., "t": wall}

The episode sleeps a time that depends only on the task index, and returns tokens that are
a pure function of it, so a run's loaded samples can be checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward, TurnRecord
from engine.domain import Task, TerminationReason

RECORD_ENV = "FAULTS_RECORD"
SLEEP_ENV = "FAULTS_SLEEP_S"


def prompt_ids(index: int) -> tuple[int, ...]:
    return (1, 2, 3, 10 + index % 90)


def response_ids(index: int) -> tuple[int, ...]:
    return tuple(100 + (index * 7 + i) % 400 for i in range(4))


def episode_seconds(index: int, base: float) -> float:
    return base * (1.0 + (index * 37 % 11) / 10.0)


def _record(kind: str, task: Task, context: EpisodeContext) -> None:
    path = os.environ.get(RECORD_ENV)
    if not path:
        return
    line = json.dumps({
        "ev": kind, "sid": task.sample_id, "attempt": context.attempt,
        "node": context.node or "", "pid": os.getpid(), "t": time.time(),
    }) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class RecordingAgent(BaseAgent):
    """See the module docstring."""

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        _record("start", task, context)
        await asyncio.sleep(episode_seconds(task.index, float(os.environ.get(SLEEP_ENV, "0.5"))))
        _record("end", task, context)
        return AgentResult(
            prompt_token_ids=prompt_ids(task.index),
            response_token_ids=response_ids(task.index),
            response_logprobs=(-0.125, -0.25, -0.375, -0.5),
            loss_mask=(1, 1, 1, 1),
            turns=(TurnRecord(index=0, prompt_tokens=4, response_tokens=4),),
            termination_reason=TerminationReason.FINISH,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return 1.0
