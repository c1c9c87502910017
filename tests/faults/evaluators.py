"""Evaluator config of the fault suite: one profile whose batch takes 6 placement tokens
(6 CPUs, 1 per running sample), so a 2-node layout of 6 CPUs each runs two batches at once."""

from __future__ import annotations

from engine.agents.base import BaseAgent
from engine.domain import EvaluatorProfile, Resource
from tests.faults.agent import RecordingAgent

TOKENS_PER_NODE = 6


def evaluator_profiles(args: object) -> list[EvaluatorProfile]:
    return [
        EvaluatorProfile(
            evaluator_id="fault",
            resource=Resource(concurrency=6, cpu=6.0),
            run_resource=Resource(cpu=1.0),
            batch_size=6,
        )
    ]


def build_agents(args: object) -> dict[str, BaseAgent]:
    return {"fault": RecordingAgent()}
