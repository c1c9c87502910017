"""One outcome family: how an episode ended, and everything derived from that.

Four views of one fact, one family with explicit derivations, so a value of one can never
disagree with the others::

    TerminationReason ──is_abort──▶ AbortClass ──▶ FailureClass   (summaries)
            │                                          ▲
            │ status                                   │ failure_class(reward)
            ▼                                          │
       SampleStatus (the trainer's)          TerminationReason + reward

* ``TerminationReason``: why an episode ended -- the agent's own reasons (``finish``,
  ``length``, ``max_turns``, ``max_context``) followed by the abort classes, then
  ``version_span`` (a truncation the engine decided: the request's cap on the weight
  versions one trajectory may span).
* ``AbortClass``: the subset of reasons that abort a sample (the evaluator's
  ``classify_abort``); its values are spelled exactly as the reasons they derive from.
* ``FailureClass``: the eight summary classes (seeds: ``classify_termination``): the four
  abort classes, then ``success`` / ``truncated_turns`` / ``truncated_context`` /
  ``wrong_answer`` decided by the reward and the reason; plus the two classes of samples the
  engine ended on purpose (``stale``, ``tail_aborted``), which summaries list only when a
  sample has one.
* ``SampleStatus``: the trainer's lifecycle name of a sample (slime's ``Sample.Status``).

Events carry these enums (``SampleCompleted.status`` / ``termination_reason``,
``SampleAborted.abort_class`` / ``agent_reason``); on the wire they are their string values,
and a value outside the family does not decode (the entry is dead-lettered). This module
imports nothing from the engine, so the domain and the events can both use it.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["AbortClass", "FailureClass", "SampleStatus", "TerminationReason"]


class SampleStatus(StrEnum):
    """Lifecycle of one sample, named as the trainer (slime's ``Sample.Status``) knows them."""

    PENDING = "pending"
    COMPLETED = "completed"  # the episode ended on its own terms
    TRUNCATED = "truncated"  # a stopping criterion ended the episode
    ABORTED = "aborted"  # a classified failure; the sample is a masked dummy
    FAILED = "failed"  # the episode or its scoring failed and no trajectory is kept; never trained


class FailureClass(StrEnum):
    """The eight outcome classes of a summary; see :meth:`TerminationReason.failure_class`."""

    SUCCESS = "success"
    WRONG_ANSWER = "wrong_answer"
    TRUNCATED_TURNS = "truncated_turns"
    TRUNCATED_CONTEXT = "truncated_context"
    AGENT_TIMEOUT = "agent_timeout"
    INFRA_CONN = "infra_conn"
    INFRA_SANDBOX = "infra_sandbox"
    INFRA_OTHER = "infra_other"
    # Ended by the engine, not by the agent or a failure: not among the eight
    # classes of an ordinary summary, which lists these only when a sample has one.
    STALE = "stale"
    TAIL_ABORTED = "tail_aborted"

    @property
    def engine_ended(self) -> bool:
        """The engine ended the sample on purpose (staleness bound, partial-rollout tail)."""
        return self in (FailureClass.STALE, FailureClass.TAIL_ABORTED)

    @property
    def correct(self) -> bool:
        return self is FailureClass.SUCCESS

    @classmethod
    def of(cls, reward: float, reason: TerminationReason | None) -> FailureClass:
        """The class of an outcome; without a reason, the reward alone decides."""
        if reason is not None:
            return reason.failure_class(reward)
        return cls.SUCCESS if reward > 0 else cls.WRONG_ANSWER


class AbortClass(StrEnum):
    """How a failed sample is bucketed (seeds: classify_abort); each is a termination reason."""

    AGENT_TIMEOUT = "agent_timeout"
    INFRA_CONN = "infra_conn"
    INFRA_SANDBOX = "infra_sandbox"
    INFRA_OTHER = "infra_other"
    STALE = "stale"
    TAIL_ABORTED = "tail_aborted"

    @property
    def reason(self) -> TerminationReason:
        """The termination reason an aborted sample reports."""
        return TerminationReason(self.value)

    @property
    def failure_class(self) -> FailureClass:
        """Aborts win over the reward: each abort class is its own failure class."""
        return FailureClass(self.value)


class TerminationReason(StrEnum):
    """Why an episode ended: the agent's own reasons, then the abort classes."""

    FINISH = "finish"  # the agent or the model declared the task done
    LENGTH = "length"  # the last generation hit its token budget
    MAX_TURNS = "max_turns"
    MAX_CONTEXT = "max_context"  # the context window is full
    AGENT_TIMEOUT = "agent_timeout"  # the episode window elapsed
    INFRA_CONN = "infra_conn"  # the model server could not be reached or aborted
    INFRA_SANDBOX = "infra_sandbox"  # the sandbox failed
    INFRA_OTHER = "infra_other"  # anything else, including dead-lettered deliveries
    # Ended by the engine. ``stale``: the sample could no longer meet its
    # rollout's staleness bound (a turn already ran on weights older than the trainer's
    # current version minus ``max_staleness``), so no further turn was generated.
    # ``tail_aborted``: the sample was in the tail of an over-provisioned rollout that became
    # ready without it (``tail="abort"``); its requests were aborted on the model server.
    STALE = "stale"
    TAIL_ABORTED = "tail_aborted"
    # The trajectory would have spanned more weight versions than its request's
    # ``max_version_span`` (at the start of a turn, or continuing a turn a weight sync
    # interrupted): kept as it stands, truncated there.
    VERSION_SPAN = "version_span"

    @property
    def abort_class(self) -> AbortClass | None:
        """The abort class this reason is, or None for the agent's own reasons."""
        return _ABORT_OF.get(self)

    @property
    def is_abort(self) -> bool:
        return self in _ABORT_OF

    @property
    def status(self) -> SampleStatus:
        """The sample status an episode ending for this reason gets."""
        if self is TerminationReason.FINISH:
            return SampleStatus.COMPLETED
        if self.is_abort:
            return SampleStatus.ABORTED
        return SampleStatus.TRUNCATED

    def failure_class(self, reward: float) -> FailureClass:
        """The summary class (first matching rule wins): an abort is its own class; else a
        positive reward is ``success``; else ``max_turns`` is ``truncated_turns``,
        ``max_context`` / ``length`` are ``truncated_context`` and the rest (a clean
        ``finish`` included) is ``wrong_answer``."""
        abort = _ABORT_OF.get(self)
        if abort is not None:
            return abort.failure_class
        if reward > 0:
            return FailureClass.SUCCESS
        return _TRUNCATED.get(self, FailureClass.WRONG_ANSWER)


_ABORT_OF: dict[TerminationReason, AbortClass] = {
    TerminationReason(c.value): c for c in AbortClass
}
_TRUNCATED: dict[TerminationReason, FailureClass] = {
    TerminationReason.MAX_TURNS: FailureClass.TRUNCATED_TURNS,
    TerminationReason.MAX_CONTEXT: FailureClass.TRUNCATED_CONTEXT,
    TerminationReason.LENGTH: FailureClass.TRUNCATED_CONTEXT,
    TerminationReason.VERSION_SPAN: FailureClass.TRUNCATED_CONTEXT,
}
