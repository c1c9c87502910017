"""``Sample``: one trajectory as the trainer sees it.

Field names follow slime's ``Sample`` (``tokens``, ``response_length``, ``loss_mask``,
``rollout_log_probs``, ``reward``, ``status``, ``remove_sample``, ...) so trainer code written
against slime reads ours unchanged. Unlike slime's, the record is frozen: later stages derive a
new one with ``model_copy(update=...)`` instead of editing it in place.

Token-level fields are packed arrays (``TokenIds`` int32, ``Mask`` uint8, ``LogProbs``
float32; see ``engine.events.arrays``), the form they have in the log: rebuilding a sample
from its events copies bytes, not numbers, and ``collate`` fills each batch tensor from them
in one pass. The constructor also accepts lists, tuples or numpy arrays and packs them.

``token_versions`` (int32, one per response token, when recorded) is the weight version the
model server reported for the turn that sampled each token; observation tokens and tokens of
unknown version hold -1 (``UNKNOWN_VERSION``). It is left out of ``model_dump`` when None, so
samples of rollouts recorded before it dump as they did.

Invariants, checked at construction: ``tokens`` is the prompt's tokens followed by the
response's, so ``response_length <= len(tokens)``; ``loss_mask`` has one 0/1 entry per response
token; ``rollout_log_probs`` and ``teacher_log_probs``, when present, too.

Two constructors cover the evaluator's outcomes: ``from_agent_result`` for a finished episode
(an inconsistent result is an ``AgentError`` naming the task) and ``masked_dummy`` for an
aborted one: two zero tokens, fully masked, ``remove_sample=True``, so it carries no gradient
while keeping the trainer's batch shape intact. ``as_stale`` marks a kept stale sample: it
stays in its group's statistics (``remove_sample`` False) with an all-zero ``loss_mask``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import (
    Field,
    JsonValue,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Strict,
    model_serializer,
    model_validator,
)

from engine.agents.result import AgentResult, check_response_arrays
from engine.domain import (
    FrozenModel,
    NonNegInt,
    Prompt,
    SampleStatus,
    Task,
    TerminationReason,
)
from engine.errors import AgentError
from engine.events.arrays import LogProbs, Mask, TokenIds, concat

__all__ = ["DUMMY_TOKENS", "Sample"]

_OPTIONAL_FIELDS = (
    "token_versions",
    "teacher_topk_ids",
    "teacher_topk_log_probs",
    "action_mask",
    "is_teacher_mask",
)

DUMMY_TOKENS: tuple[int, int] = (0, 0)
_DUMMY_IDS = TokenIds.from_values(DUMMY_TOKENS)
_DUMMY_MASK = Mask.from_values([0] * len(DUMMY_TOKENS))
_DUMMY_LOGPROBS = LogProbs.from_values([0.0] * len(DUMMY_TOKENS))

_Score = Annotated[float, Strict()]


class Sample(FrozenModel):
    """A trajectory with its reward, ready to collate; see the module docstring."""

    index: NonNegInt
    group_index: NonNegInt
    sample_id: str = ""
    prompt: Prompt = ""
    response: str = ""
    label: JsonValue = None
    tokens: TokenIds
    response_length: NonNegInt
    loss_mask: Mask
    rollout_log_probs: LogProbs | None = None
    teacher_log_probs: LogProbs | None = None
    # Per-token teacher lanes (engine.projections.lanes): the teacher's top-K ids and logprobs
    # per response token, flattened row-major (``teacher_top_k`` per position), the action
    # mask (student action tokens only) and the is-teacher mask (DAgger rollin). None when the
    # lane records none; left out of ``model_dump`` then.
    teacher_top_k: NonNegInt = 0
    teacher_topk_ids: TokenIds | None = None
    teacher_topk_log_probs: LogProbs | None = None
    action_mask: Mask | None = None
    is_teacher_mask: Mask | None = None
    reward: _Score | dict[str, _Score] = 0.0
    status: SampleStatus = SampleStatus.PENDING
    termination_reason: TerminationReason | None = None
    remove_sample: bool = False
    policy_version: NonNegInt | None = None
    token_versions: TokenIds | None = None
    # A stale sample a ready rollout kept (the ``keep`` staleness policy): its reward counts
    # in its group's statistics, its ``loss_mask`` is all zeros, so it gives no gradient.
    stale: bool = False
    metadata: dict[str, JsonValue] = Field(default_factory=dict)

    @model_serializer(mode="wrap")
    def _dump(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, object]:
        out: dict[str, object] = handler(self)
        # Dumps stay as before these fields existed when they are unset.
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is None:
                out.pop(name, None)
        if not self.teacher_top_k:
            out.pop("teacher_top_k", None)
        if not self.stale:
            out.pop("stale", None)
        return out

    def as_stale(self) -> Sample:
        """This sample kept stale: ``stale`` set and every response token masked out."""
        mask = Mask(bytes(len(self.loss_mask)))
        return self.model_copy(update={"stale": True, "loss_mask": mask})

    @model_validator(mode="after")
    def _arrays_line_up(self) -> Sample:
        if self.response_length > len(self.tokens):
            raise ValueError(
                f"response_length {self.response_length} exceeds the {len(self.tokens)} tokens"
            )
        check_response_arrays(self.response_length, self.loss_mask, self.rollout_log_probs)
        if (
            self.teacher_log_probs is not None
            and len(self.teacher_log_probs) != self.response_length
        ):
            raise ValueError(
                f"teacher_log_probs has {len(self.teacher_log_probs)} entries for "
                f"{self.response_length} response tokens"
            )
        for name in ("action_mask", "is_teacher_mask"):
            mask = getattr(self, name)
            if mask is not None:
                check_response_arrays(self.response_length, mask, None, name=name)
        k = self.teacher_top_k
        for name in ("teacher_topk_ids", "teacher_topk_log_probs"):
            rows = getattr(self, name)
            if (rows is None) != (k == 0):
                raise ValueError(f"{name} must be given exactly when teacher_top_k > 0")
            if rows is not None and len(rows) != k * self.response_length:
                raise ValueError(
                    f"{name} has {len(rows)} entries for {self.response_length} response "
                    f"tokens of top-{k}"
                )
        if self.token_versions is not None and len(self.token_versions) != self.response_length:
            raise ValueError(
                f"token_versions has {len(self.token_versions)} entries for "
                f"{self.response_length} response tokens"
            )
        return self

    @classmethod
    def from_agent_result(
        cls,
        task: Task,
        result: AgentResult,
        reward: float | dict[str, float],
        *,
        policy_version: int | None = None,
        require_tokens: bool = True,
    ) -> Sample:
        """The trainer's view of a finished episode.

        With ``require_tokens`` (training) the result must carry at least one response token
        and a logprob for each; without it (eval of a black-box scaffold) missing logprobs
        become ``rollout_log_probs=None``. Raises ``AgentError`` naming the task when the
        token arrays do not line up.
        """
        where = f"task {task.sample_id} (dataset {task.dataset_name!r})"
        # tokens = prompt + response by construction; the response arrays are checked below.
        tokens = concat([result.prompt_token_ids, result.response_token_ids])
        response_length = len(result.response_token_ids)
        logprobs: LogProbs | None = result.response_logprobs
        if require_tokens:
            if response_length == 0:
                raise AgentError(f"{where}: the agent returned no response tokens to train on")
        elif not len(result.response_logprobs):
            logprobs = None
        try:
            check_response_arrays(response_length, result.loss_mask, logprobs)
        except ValueError as exc:
            raise AgentError(
                f"{where}: inconsistent agent result: {exc} (a trainable sample needs one "
                f"logprob and one loss-mask entry per response token)"
            ) from None
        reason = result.termination_reason
        return cls(
            index=task.index,
            group_index=task.group_index,
            sample_id=task.sample_id,
            prompt=task.prompt,
            response=result.text,
            label=task.label,
            tokens=tokens,
            response_length=response_length,
            loss_mask=result.loss_mask,
            rollout_log_probs=logprobs,
            reward=reward,
            status=reason.status,
            termination_reason=reason,
            policy_version=policy_version,
            token_versions=result.response_versions if len(result.response_versions) else None,
            metadata=_task_metadata(task),
        )

    @classmethod
    def masked_dummy(
        cls,
        task: Task | None = None,
        *,
        reason: TerminationReason | None = None,
        agent_reason: TerminationReason | str | None = None,
        policy_version: int | None = None,
    ) -> Sample:
        """A zero-gradient stand-in: ``[0, 0]`` tokens, all masked, ``remove_sample=True``.

        ``reason`` is the abort class; ``agent_reason`` keeps the agent's own termination
        reason for diagnostics when it had one. Without a task (a filter emptied the rollout)
        the dummy has index and group 0 and an empty prompt.
        """
        metadata = _task_metadata(task) if task is not None else {}
        if agent_reason is not None:
            metadata["termination_reason_agent"] = str(agent_reason)
        return cls(
            index=task.index if task is not None else 0,
            group_index=task.group_index if task is not None else 0,
            sample_id=task.sample_id if task is not None else "",
            prompt=task.prompt if task is not None else "",
            label=task.label if task is not None else None,
            tokens=_DUMMY_IDS,
            response_length=len(DUMMY_TOKENS),
            loss_mask=_DUMMY_MASK,
            rollout_log_probs=_DUMMY_LOGPROBS,
            reward=0.0,
            status=SampleStatus.ABORTED,
            termination_reason=reason,
            remove_sample=True,
            policy_version=policy_version,
            metadata=metadata,
        )


def _task_metadata(task: Task) -> dict[str, JsonValue]:
    return {**task.metadata, "task_type": task.task_type, "dataset": task.dataset_name}
