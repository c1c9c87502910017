"""Fixtures of the integration tests: hand-built engine samples in the shapes a multi-turn
tool episode has."""

from __future__ import annotations

import importlib.util

import pytest

from engine.outcomes import SampleStatus
from engine.sample import Sample
from tests.redis_server import redis_required


def need(module: str, extra: str) -> None:
    """Skip when ``module`` does not import (its extra is not installed); in CI, fail."""
    if importlib.util.find_spec(module) is None:
        if redis_required():  # CI installs the dev extra, which holds this one
            pytest.fail(f"{module} is missing in CI: the dev extra must install {extra}")
        pytest.skip(f"{module} is not installed (pip install 'rollout-engine[{extra}]')")


def tool_episode(
    index: int, group: int, *, reward: float = 1.0, version: int = 3,
    teacher: list[float] | None = None,
) -> Sample:
    """Prompt [11, 12, 13]; a model turn [20, 21], tool output [30, 31, 32] (masked), a model
    turn [22, 23]; the sampler's logprobs on model tokens, 0 on tool output."""
    mask = [1, 1, 0, 0, 0, 1, 1]
    return Sample(
        index=index, group_index=group, sample_id=f"r:s{index}", prompt="Compute 2 plus 3.",
        response="a call, its output, the answer",
        tokens=[11, 12, 13, 20, 21, 30, 31, 32, 22, 23], response_length=7, loss_mask=mask,
        rollout_log_probs=[-0.5, -0.25, 0.0, 0.0, 0.0, -1.5, -0.125], teacher_log_probs=teacher,
        reward=reward, status=SampleStatus.COMPLETED, policy_version=version,
        token_versions=[version if m else -1 for m in mask],
        metadata={"dataset": "math_train", "id": f"math-{group}"},
    )
