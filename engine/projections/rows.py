"""One sample's outcome with its diagnostics: the row ``eval_details.jsonl`` lists and the
evaluator's progress callback hears, derived once, by :func:`sample_row`:

* completed: the event's reward, status and termination reason, its failure class, the
  response length;
* aborted: reward 0, status ``aborted``, the abort class's reason and failure class, the
  agent's own reason and diagnostics;
* not terminal: status ``pending``, counted as ``infra_other`` with error
  ``"no terminal event"`` so per-dataset totals always add up.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.events.catalog import SampleAborted, SampleCompleted, TaskFetched
from engine.outcomes import AbortClass, FailureClass, SampleStatus, TerminationReason
from engine.projections.readback import Rollout

__all__ = ["SampleRow", "sample_row", "sample_rows"]


@dataclass(frozen=True, slots=True)
class SampleRow:
    rollout_id: str
    sample_id: str
    index: int
    group_index: int
    dataset: str
    task_type: str
    reward: float
    failure_class: FailureClass
    status: SampleStatus
    termination_reason: TerminationReason | None
    agent_reason: TerminationReason | None
    abort_class: AbortClass | None
    error: str
    phase: str
    attempt: int
    turns: int
    response_length: int
    elapsed_s: float
    window_s: float | None
    node: str
    batch_id: str = ""

    @property
    def correct(self) -> bool:
        return self.failure_class.correct

    @property
    def completed(self) -> bool:
        """The sample ended with a trajectory (``SampleCompleted``)."""
        return self.status is not SampleStatus.ABORTED and self.status is not SampleStatus.PENDING

    @property
    def aborted(self) -> bool:
        return self.status is SampleStatus.ABORTED


def sample_row(
    task: TaskFetched | None,
    terminal: SampleCompleted | SampleAborted | None,
    *,
    sample_id: str = "",
    attempt: int = 0,
    turns: int = 0,
    node: str = "",
    batch_id: str = "",
) -> SampleRow:
    """``attempt``, ``turns`` and ``node`` are what is known besides the terminal event (an
    abort carries its own); ``task`` is None only when the sample's ``TaskFetched`` is missing."""
    if task is not None:
        sample_id, rollout_id = task.sample_id, task.rollout_id
    elif terminal is not None:
        sample_id, rollout_id = terminal.sample_id, terminal.rollout_id
    else:
        rollout_id = ""
    pending = SampleRow(
        rollout_id=rollout_id,
        sample_id=sample_id,
        index=task.index if task is not None else 0,
        group_index=task.group_index if task is not None else 0,
        dataset=task.dataset if task is not None else "",
        task_type=task.task_type if task is not None else "",
        reward=0.0,
        failure_class=FailureClass.INFRA_OTHER,
        status=SampleStatus.PENDING,
        termination_reason=None,
        agent_reason=None,
        abort_class=None,
        error="no terminal event",
        phase="",
        attempt=attempt,
        turns=turns,
        response_length=0,
        elapsed_s=0.0,
        window_s=None,
        node=node,
        batch_id=batch_id,
    )
    if isinstance(terminal, SampleCompleted):
        reason = terminal.termination_reason
        return replace(
            pending,
            reward=float(terminal.reward),
            failure_class=FailureClass.of(terminal.reward, reason),
            status=terminal.status,
            termination_reason=reason,
            error="",
            attempt=terminal.attempt,
            turns=terminal.n_turns or turns,
            response_length=len(terminal.response_ids),
            elapsed_s=terminal.elapsed_s,
        )
    if isinstance(terminal, SampleAborted):
        abort = terminal.abort_class
        return replace(
            pending,
            failure_class=abort.failure_class,
            status=SampleStatus.ABORTED,
            termination_reason=abort.reason,
            agent_reason=terminal.agent_reason,
            abort_class=abort,
            error=terminal.error,
            phase=terminal.phase,
            attempt=terminal.attempt,
            turns=terminal.turns,
            elapsed_s=terminal.elapsed_s,
            window_s=terminal.window_s,
            node=terminal.node,
        )
    return pending


def sample_rows(rollout: Rollout) -> list[SampleRow]:
    """Every sample's row, in sample-index order. A ready rollout's tail samples without a
    terminal event read ``tail_aborted``, or, when the tail is carried, stay ``pending`` with
    an error naming the request stream that takes it over."""
    state = rollout.state
    ready = state.ready
    tail = set(ready.tail_sample_ids) if ready is not None else set()
    stream = state.request.request_stream if state.request is not None else None
    rows: list[SampleRow] = []
    for r in state.ordered():
        terminal = rollout.terminal(r)
        row = sample_row(
            rollout.task(r),
            terminal,
            attempt=max(r.attempt, 0),
            turns=r.turns,
            node=r.node,
            batch_id=r.batch_id,
        )
        if terminal is None and r.sample_id in tail:
            assert ready is not None
            if ready.tail_carried:
                row = replace(row, error=f"carried to the next request of stream {stream!r}")
            else:
                row = replace(
                    row,
                    failure_class=FailureClass.TAIL_ABORTED,
                    status=SampleStatus.ABORTED,
                    termination_reason=TerminationReason.TAIL_ABORTED,
                    abort_class=AbortClass.TAIL_ABORTED,
                    error="tail of an over-provisioned rollout",
                )
        rows.append(row)
    return rows
