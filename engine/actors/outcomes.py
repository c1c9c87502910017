"""A sample attempt's outcome as events: pure functions of what the attempt produced.

The ``BatchRun`` runs an episode and keeps an :class:`Attempt` record (phase, node, turns,
time used). :func:`started_event` is the ``SampleStarted`` once its placement token is held;
when the episode ends, exactly one of these decides what goes to the log:

* :func:`completed_events` -- one ``TurnCompleted`` per turn of the agent's result, then
  ``SampleCompleted`` (the reward scalarised; a reward that is neither a float nor a dict of
  floats raises ``AgentError``, which the caller turns into an abort in phase ``eval``);
* :func:`aborted_event` -- ``SampleAborted`` with the abort class (the agent's own reason
  when it returned one, :func:`classify_abort` otherwise) and the attempt's diagnostics.

What the progress callback hears about a terminal event is the one per-sample view,
:func:`engine.projections.rows.sample_row`.

No clock, no I/O: the tests drive them with hand-built results and exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.actors.aborts import classify_abort, describe_exception
from engine.agents.base import AgentResult, Reward
from engine.domain import TerminationReason
from engine.errors import AgentError
from engine.events.arrays import Mask, TokenIds
from engine.events.base import Event
from engine.events.catalog import (
    AbortClass,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TurnCompleted,
)
from engine.events.fastpath import field_layout, trusted
from engine.projections.samples import scalar_reward

__all__ = [
    "Attempt",
    "ReportedAbort",
    "aborted_event",
    "completed_events",
    "started_event",
]


@dataclass(slots=True)
class Attempt:
    """Diagnostics of one running attempt (local to one coroutine, filled as it runs)."""

    phase: str = "init"
    node: str = ""
    gpu: int | None = None
    turns: int = 0
    used_s: float = 0.0
    window_s: float | None = None
    agent_reason: TerminationReason | None = None


class ReportedAbort(Exception):  # noqa: N818 -- the agent's verdict, not our error
    """The agent returned an abort reason instead of raising."""

    def __init__(self, reason: TerminationReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


def started_event(
    *,
    rollout_id: str,
    sample_id: str,
    attempt: int,
    batch_id: str,
    worker: str,
    node: str,
    causation: str | None,
) -> SampleStarted:
    """The ``SampleStarted`` of an attempt that holds its placement token (on ``node``)."""
    return trusted(  # every value is already a str (the attempt an int)
        SampleStarted,
        {
            "type": "SampleStarted",
            "producer": "",
            "causation": causation,
            "rollout_id": rollout_id,
            "sample_id": sample_id,
            "attempt": attempt,
            "batch_id": batch_id,
            "worker": worker,
            "node": node,
        },
        _STARTED_SET,
    )


def completed_events(
    *,
    rollout_id: str,
    sample_id: str,
    attempt: int,
    rec: Attempt,
    result: AgentResult,
    reward: Reward | None,
    policy_version: int,
    causation: str | None,
    prompt_key: str = "",
) -> list[Event]:
    """``TurnCompleted`` per turn, then ``SampleCompleted`` (see the module docstring).
    With ``prompt_key`` the prompt tokens are not repeated: the event refers to the
    rollout's ``PromptStored`` of that key."""
    score, detail = _scalar(sample_id, reward)
    # Every value below is already of its field's type (the result, its turns and the
    # attempt record were validated or built here), so the events are built without a
    # second validation (engine.events.fastpath.trusted); floats are made floats.
    reason = result.termination_reason
    teacher_mask = result.teacher_mask
    done = trusted(
        SampleCompleted,
        {
            "type": "SampleCompleted",
            "producer": "",
            "causation": causation,
            "rollout_id": rollout_id,
            "sample_id": sample_id,
            "attempt": attempt,
            "prompt_ids": TokenIds.empty() if prompt_key else result.prompt_token_ids,
            "response_ids": result.response_token_ids,
            "logprobs": result.response_logprobs,
            "loss_mask": result.loss_mask,
            "reward": score,
            "reward_detail": detail,
            "status": reason.status,
            "termination_reason": reason,
            "response_text": result.text,
            "n_turns": len(result.turns),
            "elapsed_s": float(rec.used_s),
            "policy_version": policy_version,
            "metrics": dict(result.metrics),
            "token_versions": result.response_versions,
            "teacher_mask": teacher_mask if teacher_mask is not None else Mask.empty(),
            "student_cut_points": list(result.student_cut_points),
            "prompt_key": prompt_key,
        },
        _DONE_SET,
    )
    return [*_turn_events(rollout_id, sample_id, attempt, rec, result, causation), done]


def _scalar(sample_id: str, reward: Reward | None) -> tuple[float, dict[str, Any]]:
    """The reward as ``(score, detail)``; ``AgentError`` when it is no float or dict of them."""
    if isinstance(reward, Mapping):
        detail = {str(k): float(v) for k, v in reward.items()}
        return scalar_reward(detail), detail
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        return float(reward), {}
    raise AgentError(
        f"task {sample_id}: eval must return a float or a dict of floats, "
        f"got {type(reward).__name__}"
    )


def _turn_events(
    rollout_id: str,
    sample_id: str,
    attempt: int,
    rec: Attempt,
    result: AgentResult,
    causation: str | None,
) -> list[Event]:
    node, gpu = rec.node, rec.gpu
    return [
        trusted(
            TurnCompleted,
            {
                "type": "TurnCompleted",
                "producer": "",
                "causation": causation,
                "rollout_id": rollout_id,
                "sample_id": sample_id,
                "attempt": attempt,
                "turn": t.index,
                "node": node,
                "gpu": gpu,
                "prompt_tokens": t.prompt_tokens,
                "response_tokens": t.response_tokens,
                "tool_calls": list(t.tool_calls),
                "elapsed_s": float(t.elapsed_s),
                "weight_version": t.weight_version,
            },
            _TURN_SET,
        )
        for t in result.turns
    ]


_STARTED_SET = field_layout(
    SampleStarted,
    ("type", "producer", "causation", "rollout_id", "sample_id", "attempt", "batch_id",
     "worker", "node"),
)  # fmt: skip
_TURN_SET = field_layout(
    TurnCompleted,
    ("type", "producer", "causation", "rollout_id", "sample_id", "attempt", "turn", "node",
     "gpu", "prompt_tokens", "response_tokens", "tool_calls", "elapsed_s", "weight_version"),
)  # fmt: skip
_DONE_SET = field_layout(
    SampleCompleted,
    ("type", "producer", "causation", "rollout_id", "sample_id", "attempt", "prompt_ids",
     "response_ids", "logprobs", "loss_mask", "reward", "reward_detail", "status",
     "termination_reason", "response_text", "n_turns", "elapsed_s", "policy_version",
     "metrics", "token_versions", "teacher_mask", "student_cut_points", "prompt_key"),
)  # fmt: skip


def aborted_event(
    *,
    rollout_id: str,
    sample_id: str,
    attempt: int,
    rec: Attempt,
    exc: BaseException,
    causation: str | None,
) -> SampleAborted:
    """The ``SampleAborted`` of an attempt that ended with ``exc`` in ``rec.phase``."""
    if isinstance(exc, ReportedAbort):
        abort_class = AbortClass(exc.reason.value)
        error = f"the agent ended the episode with {exc.reason.value}"
    else:
        abort_class = classify_abort(exc)
        error = describe_exception(exc)
    return SampleAborted(
        rollout_id=rollout_id,
        sample_id=sample_id,
        attempt=attempt,
        abort_class=abort_class,
        error=error,
        agent_reason=rec.agent_reason or _agent_reason_of(exc),
        phase=rec.phase,
        elapsed_s=rec.used_s,
        window_s=rec.window_s,
        node=rec.node,
        turns=rec.turns,
        causation=causation,
    )


def _agent_reason_of(exc: BaseException) -> TerminationReason | None:
    reason = getattr(exc, "termination_reason", None)
    if isinstance(reason, TerminationReason):
        return reason
    try:
        return TerminationReason(reason) if isinstance(reason, str) else None
    except ValueError:  # not a reason of the family: nothing to report
        return None
