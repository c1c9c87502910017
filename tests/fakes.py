"""Small real implementations of the engine's ports for unit tests."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward
from engine.domain import Task, TerminationReason


class FixedAgent(BaseAgent):
    """Answers every task with one fixed result and reward."""

    def __init__(self, result: AgentResult | None = None, reward: Reward = 1.0) -> None:
        self.result = result or AgentResult(
            prompt_token_ids=(1, 2),
            response_token_ids=(3,),
            response_logprobs=(-0.5,),
            loss_mask=(1,),
            termination_reason=TerminationReason.FINISH,
        )
        self.reward = reward

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        return self.result

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        return self.reward


def write_jsonl(path: Path, rows: Iterable[Mapping[str, Any] | str]) -> Path:
    """Write rows (dicts as JSON, strings verbatim) one per line."""
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path
