"""The episode contract: one ``BaseAgent`` owns the whole episode of one sample.

The evaluator drives every sample through ``init -> run -> eval -> cleanup``:

- ``init`` is lightweight preparation before any placement token is held;
- ``run`` is the full multi-turn loop and returns an ``AgentResult``;
- ``eval`` scores that result (a float, or a dict of named scores);
- ``cleanup`` always runs (a ``finally``), also after a failure, to stop containers.

The evaluator holds one placement token from before ``run`` until after ``cleanup`` and runs
the whole episode under the evaluator's semaphore. An exception from any phase aborts the
sample: the evaluator classifies it and substitutes a masked dummy, so agents raise instead of
returning half-valid results.

Token arrays of an ``AgentResult`` obey ``len(loss_mask) == len(response_token_ids)`` and
``response_logprobs`` is either empty (not captured, e.g. a black-box scaffold in eval) or of
the same length. ``loss_mask`` is 1 on tokens the policy is trained on, 0 elsewhere (tool
output, teacher tokens).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from engine.domain import (
    FrozenModel,
    NonNegFloat,
    NonNegInt,
    SamplingParams,
    StoppingCriteria,
    Task,
    TerminationReason,
)
from engine.events.arrays import LogProbs, Mask, TokenIds

__all__ = [
    "AgentResult",
    "BaseAgent",
    "EpisodeContext",
    "Reward",
    "TurnRecord",
    "check_response_arrays",
]

Reward = float | dict[str, float]


def check_response_arrays(
    response_length: int, loss_mask: Mask, logprobs: LogProbs | None
) -> None:
    """Raise ``ValueError`` unless the per-response-token arrays line up.

    ``logprobs=None`` means "not captured"; an empty array for a non-empty response counts as
    a mismatch here, callers that allow missing logprobs pass ``None``.
    """
    if len(loss_mask) != response_length:
        raise ValueError(
            f"loss_mask has {len(loss_mask)} entries for {response_length} response tokens"
        )
    if logprobs is not None and len(logprobs) != response_length:
        raise ValueError(
            f"response logprobs have {len(logprobs)} entries for {response_length} response tokens"
        )
    if loss_mask.data.translate(None, _BITS):  # anything left is neither 0 nor 1
        raise ValueError("loss_mask entries must be 0 or 1")


_BITS = b"\x00\x01"
_NON_NEGATIVE_TOP_BYTES = bytes(range(128))


def _has_negative(ids: TokenIds) -> bool:
    # int32 little-endian: a value is negative iff its top byte (every 4th, from 3) has the
    # sign bit set; one C pass over the bytes, no array built.
    return bool(ids.data[3::4].translate(None, _NON_NEGATIVE_TOP_BYTES))


class TurnRecord(FrozenModel):
    """What one turn of an episode did, for summaries and diagnostics."""

    index: NonNegInt
    prompt_tokens: NonNegInt
    response_tokens: NonNegInt
    tool_calls: tuple[str, ...] = ()  # names of the tools called this turn
    elapsed_s: NonNegFloat = 0.0
    finish_reason: str | None = None  # the backend's, e.g. "stop", "length", "tool_calls"


class AgentResult(FrozenModel):
    """The outcome of ``BaseAgent.run``: the trajectory's tokens and how the episode ended.

    The token arrays are packed (``TokenIds`` int32, ``LogProbs`` float32, ``Mask`` uint8),
    the form they keep until the trainer's ``collate``; the constructor also takes lists,
    tuples or numpy arrays of numbers and packs them once, here.
    """

    prompt_token_ids: TokenIds = Field(default_factory=TokenIds.empty)
    response_token_ids: TokenIds = Field(default_factory=TokenIds.empty)
    response_logprobs: LogProbs = Field(default_factory=LogProbs.empty)
    loss_mask: Mask = Field(default_factory=Mask.empty)
    turns: tuple[TurnRecord, ...] = ()
    termination_reason: TerminationReason
    metrics: dict[str, float] = Field(default_factory=dict)
    text: str = ""

    @field_validator("prompt_token_ids", "response_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, ids: TokenIds) -> TokenIds:
        if _has_negative(ids):
            raise ValueError("token ids must be non-negative")
        return ids

    @model_validator(mode="after")
    def _arrays_line_up(self) -> AgentResult:
        check_response_arrays(
            len(self.response_token_ids),
            self.loss_mask,
            self.response_logprobs if len(self.response_logprobs) else None,
        )
        return self

    @property
    def has_logprobs(self) -> bool:
        """Whether the policy's logprobs were captured for every response token."""
        return len(self.response_logprobs) == len(self.response_token_ids) > 0


@dataclass(frozen=True, kw_only=True)
class EpisodeContext:
    """Everything an episode may use besides its task; built by the evaluator per attempt.

    ``stopping`` and ``sampling_params`` are already resolved through the cascade.
    ``attempt`` counts deliveries of the sample from 1; ``seed`` is derived from the rollout
    request, so a re-run attempt can reproduce sampling. Per-iteration knobs (``dagger_beta``,
    ``t_max``) travel here, never in environment variables. ``tmp_dir`` is private to this
    attempt and removed by the evaluator after ``cleanup``.
    """

    rollout_id: str
    sample_id: str
    attempt: int
    sglang_url: str
    stopping: StoppingCriteria
    sampling_params: SamplingParams
    # Whatever engine.sandbox exposes to open a sandbox for this episode; typed loosely so
    # this contract does not depend on a sandbox implementation.
    sandbox_factory: Any
    tmp_dir: Path
    policy_version: int = 0
    seed: int = 0
    node: str | None = None  # the node the sample's placement token lives on
    dagger_beta: float | None = None
    t_max: int | None = None

    def __post_init__(self) -> None:
        if self.attempt < 1:
            raise ValueError(f"attempt counts from 1, got {self.attempt}")
        if self.dagger_beta is not None and not 0.0 <= self.dagger_beta <= 1.0:
            raise ValueError(f"dagger_beta must be within [0, 1], got {self.dagger_beta}")
        if self.t_max is not None and self.t_max < 0:
            raise ValueError(f"t_max must be non-negative, got {self.t_max}")


class BaseAgent(abc.ABC):
    """An episode handler. Subclasses implement ``run`` and ``eval``; ``init`` and
    ``cleanup`` default to doing nothing. One instance serves many concurrent episodes, so
    per-episode state belongs in locals or in ``context.tmp_dir``, never on ``self``.
    """

    async def init(self, task: Task, context: EpisodeContext) -> None:
        """Prepare the episode before any placement token is held; keep it cheap."""
        return None

    @abc.abstractmethod
    async def run(self, task: Task, context: EpisodeContext) -> AgentResult:
        """Run the whole multi-turn episode and return its trajectory."""

    @abc.abstractmethod
    async def eval(self, task: Task, context: EpisodeContext, result: AgentResult) -> Reward:
        """Score ``result``: a float, or a dict of named scores."""

    async def cleanup(self, task: Task, context: EpisodeContext) -> None:
        """Release what the episode started; runs after success and after failure alike."""
        return None
