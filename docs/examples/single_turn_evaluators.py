"""An evaluator config with one single-turn agent (docs/agents.md walks through it).

Run it with ``rollout scheduler --evaluator-config docs/examples/single_turn_evaluators.py``
and ``rollout worker --evaluator-config ... --model-dir MODEL --sglang-url URL``; datasets
whose ``task_type`` is ``qa`` are run by it. tests/ops/test_docs_examples.py runs it
against the tiny model server.
"""

from __future__ import annotations

import argparse
from typing import Any

from transformers import AutoTokenizer

from engine.agents.base import AgentResult, BaseAgent, EpisodeContext, Reward
from engine.domain import EvaluatorProfile, Resource, SamplingParams, StoppingCriteria, Task
from engine.errors import AgentError
from engine.outcomes import TerminationReason


class SingleTurnAgent(BaseAgent):
    """Asks the policy once and rewards an answer that contains the label.

    It keeps no state between phases, so it implements ``run`` and ``eval`` on itself; one
    instance serves every concurrent episode of the worker.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt_ids(self, task: Task) -> list[int]:
        messages = (
            [{"role": "user", "content": task.prompt}]
            if isinstance(task.prompt, str)
            else list(task.prompt)
        )
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(ids, add_special_tokens=False)["input_ids"])

    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        if context.backends is None:
            raise AgentError("SingleTurnAgent needs the worker's model endpoint (--sglang-url)")
        backend = context.backends.get()  # the worker's default endpoint
        prompt = self.prompt_ids(task)
        params = {
            **context.sampling_params.as_request(),  # resolved: request > profile > dataset
            "max_new_tokens": context.stopping.max_new_tokens or 64,
        }
        if context.seed:
            params.setdefault("sampling_seed", context.seed)
        gen = await backend.generate(input_ids=prompt, sampling_params=params)
        if gen.token_ids is None or gen.logprobs is None:
            raise AgentError("SingleTurnAgent needs a token-level backend (SGLang /generate)")
        return AgentResult(
            prompt_token_ids=prompt,
            response_token_ids=gen.token_ids,
            response_logprobs=gen.logprobs,
            loss_mask=[1] * len(gen.token_ids),  # every response token is the policy's
            termination_reason=(
                TerminationReason.LENGTH if gen.finish_reason == "length"
                else TerminationReason.FINISH
            ),
            text=gen.text,
        )

    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        hit = 1.0 if task.label is not None and str(task.label) in result.text else 0.0
        return {"score": hit, "contains_label": hit}  # "score" is the reward trained on


def evaluator_profiles(args: argparse.Namespace) -> list[EvaluatorProfile]:
    """Pure data: the scheduler calls only this (it builds no agent, loads no tokenizer)."""
    return [
        EvaluatorProfile(
            evaluator_id="qa",  # runs the datasets with task_type: qa
            batch_size=8,
            resource=Resource(cpu=4.0, memory_gb=8.0, concurrency=8),
            run_resource=Resource(cpu=0.5, memory_gb=1.0),
            eval_resource=Resource(cpu=0.5, memory_gb=1.0),
            default_stopping=StoppingCriteria(max_turns=1, max_new_tokens=64, timeout_s=60),
            default_sampling_params=SamplingParams(temperature=1.0),
        )
    ]


def build_agents(args: argparse.Namespace) -> dict[str, BaseAgent]:
    """The agents, by evaluator id; only evaluator workers call this."""
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    return {"qa": SingleTurnAgent(tokenizer)}
