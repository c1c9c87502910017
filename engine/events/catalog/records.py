"""The value types events share: frozen nested records, the rollout kind, free-form JSON."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

JSON = Any


class Record(BaseModel):
    """Frozen value object nested inside events."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class RolloutKind(StrEnum):
    TRAIN = "train"
    EVAL = "eval"
