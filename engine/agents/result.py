"""What an episode hands back to the engine: the trajectory's packed token arrays, how the
episode ended and what each turn did. Pure records, importing no backend, sandbox or HTTP
client, so the sample path can use them.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from engine.domain import FrozenModel, NonNegFloat, NonNegInt
from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.outcomes import TerminationReason

__all__ = ["UNKNOWN_VERSION", "AgentResult", "Reward", "TurnRecord", "check_response_arrays"]

UNKNOWN_VERSION = -1
"""The weight version of a token no policy version is known for."""

Reward = float | dict[str, float]


def check_response_arrays(
    response_length: int, loss_mask: Mask, logprobs: LogProbs | None, *, name: str = "loss_mask"
) -> None:
    """Raise ``ValueError`` unless the per-response-token arrays line up; ``logprobs=None``
    means "not captured" (an empty array for a non-empty response is a mismatch)."""
    if len(loss_mask) != response_length:
        raise ValueError(
            f"{name} has {len(loss_mask)} entries for {response_length} response tokens"
        )
    if logprobs is not None and len(logprobs) != response_length:
        raise ValueError(
            f"response logprobs have {len(logprobs)} entries for {response_length} response tokens"
        )
    if loss_mask.data.translate(None, _BITS):  # anything left is neither 0 nor 1
        raise ValueError(f"{name} entries must be 0 or 1")


_BITS = b"\x00\x01"
# Immutable, so one instance serves every default (cheaper than a default factory).
_EMPTY_TOKENIDS = TokenIds.empty()
_EMPTY_LOGPROBS = LogProbs.empty()
_EMPTY_MASK = Mask.empty()
_NON_NEGATIVE_TOP_BYTES = bytes(range(128))


def _has_negative(ids: TokenIds) -> bool:
    # int32 little-endian: negative iff the top byte (every 4th, from 3) has the sign bit.
    return bool(ids.data[3::4].translate(None, _NON_NEGATIVE_TOP_BYTES))


class TurnRecord(FrozenModel):
    """What one turn of an episode did, for summaries and diagnostics."""

    index: NonNegInt
    prompt_tokens: NonNegInt
    response_tokens: NonNegInt
    tool_calls: tuple[str, ...] = ()  # names of the tools called this turn
    elapsed_s: NonNegFloat = 0.0
    finish_reason: str | None = None  # the backend's, e.g. "stop", "length", "tool_calls"
    # What the server reported (SGLang's ``meta_info.weight_version``), never what was asked.
    weight_version: NonNegInt | None = None


class AgentResult(FrozenModel):
    """The outcome of ``BaseAgent.run``: the trajectory's tokens and how the episode ended.

    The token arrays are packed (int32, float32, uint8) until the trainer's ``collate``; the
    constructor also takes lists, tuples or numpy arrays and packs them once, here.
    """

    prompt_token_ids: TokenIds = _EMPTY_TOKENIDS
    response_token_ids: TokenIds = _EMPTY_TOKENIDS
    response_logprobs: LogProbs = _EMPTY_LOGPROBS
    loss_mask: Mask = _EMPTY_MASK
    # Per response token, the weight version that sampled it (``UNKNOWN_VERSION`` for
    # observations and unreported versions); empty when the agent records none.
    response_versions: TokenIds = _EMPTY_TOKENIDS
    turns: tuple[TurnRecord, ...] = ()
    termination_reason: TerminationReason
    metrics: dict[str, float] = Field(default_factory=dict)
    text: str = ""
    # DAgger rollin: 1 on the tokens a teacher produced; where each student turn begins.
    teacher_mask: Mask | None = None
    student_cut_points: tuple[NonNegInt, ...] = ()

    @field_validator("prompt_token_ids", "response_token_ids")
    @classmethod
    def _token_ids_non_negative(cls, ids: TokenIds) -> TokenIds:
        if _has_negative(ids):
            raise ValueError("token ids must be non-negative")
        return ids

    @model_validator(mode="after")
    def _arrays_line_up(self) -> AgentResult:
        n = len(self.response_token_ids)
        logprobs = self.response_logprobs
        check_response_arrays(n, self.loss_mask, logprobs if len(logprobs) else None)
        versions = len(self.response_versions)
        if versions and versions != n:
            raise ValueError(f"response_versions has {versions} entries for {n} response tokens")
        if self.teacher_mask is not None:
            if len(self.teacher_mask) != n:
                raise ValueError(
                    f"teacher_mask has {len(self.teacher_mask)} entries for {n} response tokens"
                )
            if self.teacher_mask.data.translate(None, _BITS):
                raise ValueError("teacher_mask entries must be 0 or 1")
        cuts = self.student_cut_points
        if cuts and (list(cuts) != sorted(set(cuts)) or cuts[-1] >= n):
            raise ValueError(
                "student_cut_points must be increasing response offsets, got "
                f"{cuts} for {n} response tokens"
            )
        return self

    @property
    def has_logprobs(self) -> bool:
        """Whether the policy's logprobs were captured for every response token."""
        return len(self.response_logprobs) == len(self.response_token_ids) > 0
