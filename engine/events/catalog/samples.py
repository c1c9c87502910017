"""What happens to each sample on its rollout's stream: attempts, turns, outcomes, scores."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from engine.events.arrays import LogProbs, Mask, TokenIds
from engine.events.base import Event, upcaster
from engine.events.catalog.records import JSON
from engine.outcomes import AbortClass, SampleStatus, TerminationReason


class SampleStarted(Event):
    type: Literal["SampleStarted"] = "SampleStarted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    batch_id: str = ""
    worker: str = ""
    node: str = ""


class TurnCompleted(Event):
    type: Literal["TurnCompleted"] = "TurnCompleted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    turn: int
    node: str = ""
    gpu: int | None = None
    prompt_tokens: int = 0
    response_tokens: int = 0
    tool_calls: list[str] = Field(default_factory=list)
    elapsed_s: float = 0.0
    # The policy version the model server reported for this turn (None: it reported none).
    weight_version: int | None = None


class SampleCompleted(Event):
    """A finished episode with its token-level trajectory and reward.

    The token ids and the masks travel in the compact, lossless form of
    ``engine.events.arrays`` (a 0/1 mask as bits, ids below 65,536 as uint16 and below 2**24
    as 3 bytes; arrays under 256 bytes raw): a 1,024-token response takes about 7.1 bytes
    per token instead of 9.
    """

    schema_version: ClassVar[int] = 3
    compact_arrays: ClassVar[frozenset[str]] = frozenset(
        {"prompt_ids", "response_ids", "loss_mask", "teacher_mask"}
    )

    type: Literal["SampleCompleted"] = "SampleCompleted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: LogProbs
    loss_mask: Mask
    reward: float = 0.0
    reward_detail: dict[str, JSON] = Field(default_factory=dict)
    status: SampleStatus = SampleStatus.COMPLETED
    termination_reason: TerminationReason | None = None
    response_text: str = ""
    n_turns: int = 0
    elapsed_s: float = 0.0
    policy_version: int = 0
    metrics: dict[str, JSON] = Field(default_factory=dict)
    # Per response token, the server-reported weight version that sampled it (a turn a
    # weight sync interrupted and continued has both); -1 for observation tokens and unknown
    # versions. Empty: not recorded.
    token_versions: TokenIds = Field(default_factory=TokenIds.empty)
    # DAgger rollin (engine.agents.dagger): 1 on response tokens the teacher produced; empty
    # when the agent recorded none (every token is then the student's or an observation).
    teacher_mask: Mask = Field(default_factory=Mask.empty)
    # The response offsets where each student-executed turn begins (the CE lane's cuts).
    student_cut_points: list[int] = Field(default_factory=list)

    # Prompt stored once: non-empty when ``prompt_ids`` is left empty and the prompt tokens
    # are those of the rollout stream's ``PromptStored`` with this key (the n samples of a
    # group share one). Empty: ``prompt_ids`` holds them.
    prompt_key: str = ""


@upcaster("SampleCompleted", 1)
def _sample_completed_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 has no DAgger rollin (``teacher_mask``, ``student_cut_points``): the defaults (no
    # teacher tokens, no cut points) say exactly that.
    payload.pop("teacher_mask", None)
    payload.pop("student_cut_points", None)
    return payload


@upcaster("SampleCompleted", 2)
def _sample_completed_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v2 holds every array raw: prefixed with the compact form's raw tag (0). Values that
    # are not wire bytes (a hand-written payload's lists) are left to validation.
    for name in SampleCompleted.compact_arrays:
        value = payload.get(name)
        if type(value) is bytes:
            payload[name] = b"\x00" + value
    return payload


class PromptStored(Event):
    """Prompt tokens that several ``SampleCompleted`` of the rollout refer to by
    ``prompt_key`` instead of repeating them (written before the first that refers to it;
    a repeat with the same key is ignored)."""

    type: Literal["PromptStored"] = "PromptStored"
    rollout_id: str
    prompt_key: str
    prompt_ids: TokenIds


class SampleAborted(Event):
    """A classified failure; the sample becomes a masked dummy."""

    type: Literal["SampleAborted"] = "SampleAborted"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    abort_class: AbortClass
    error: str = ""
    agent_reason: TerminationReason | None = None  # the agent's own, when it returned one
    phase: str = ""
    elapsed_s: float = 0.0
    window_s: float | None = None
    node: str = ""
    turns: int = 0


class TeacherScored(Event):
    """Teacher force-decode of a kept trajectory (per response token)."""

    type: Literal["TeacherScored"] = "TeacherScored"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    teacher_logprobs: LogProbs
    top_k: int = 0
    topk_ids: TokenIds = Field(default_factory=TokenIds.empty)
    topk_logprobs: LogProbs = Field(default_factory=LogProbs.empty)
    action_mask: Mask = Field(default_factory=Mask.empty)


class SampleVerified(Event):
    """The verification boundary (``engine.actors.verify``): a completed sample's sampled
    tokens re-scored on the server that generated them, at its current weight version.

    Written by the evaluator worker just before the sample's ``SampleCompleted``, for the
    fraction of samples the request selects. ``n_tokens`` sampled tokens were compared and
    ``n_other_version`` were not (a weight update since they were sampled); ``skipped`` says
    why nothing was compared (empty when something was). ``max_abs_delta`` is the largest
    ``|recorded - re-scored|`` logprob, at response index ``position``; ``exceeded`` is
    ``max_abs_delta > threshold``, and fails the rollout."""

    type: Literal["SampleVerified"] = "SampleVerified"
    rollout_id: str
    sample_id: str
    attempt: int = 0
    n_tokens: int = 0
    n_other_version: int = 0
    max_abs_delta: float = 0.0
    position: int | None = None
    weight_version: int | None = None
    threshold: float
    exceeded: bool = False
    skipped: str = ""
