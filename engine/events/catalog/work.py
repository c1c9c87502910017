"""Events of the work streams (``rl:work:{evaluator}``) and of ``rl:capture``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from engine.events.base import Event


class BatchAdmitted(Event):
    """A batch has its tokens and may run; sent to ``rl:work:{evaluator_id}``."""

    type: Literal["BatchAdmitted"] = "BatchAdmitted"
    rollout_id: str
    batch_id: str
    evaluator_id: str
    sample_ids: list[str]
    token_ids: list[str] = Field(default_factory=list)
    nodes: dict[str, str] = Field(default_factory=dict)
    # token id -> the GPU ids its grant holds a share of (for the per-turn placement log)
    gpus: dict[str, list[int]] = Field(default_factory=dict)


class CaptureRequested(Event):
    type: Literal["CaptureRequested"] = "CaptureRequested"
    rollout_id: str
    sample_ids: list[str]
    top_k: int = 20
