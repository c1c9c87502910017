"""From events to the domain: a ``TaskFetched`` to its ``Task``, and a ready rollout's
samples for the trainer.

:func:`trainer_samples` is the one way samples are rebuilt from the log (the client's ``load``
and ``iter_load`` and ``rollout replay`` all call it, so they agree by construction):

* the samples ``RolloutReady.sample_ids`` names, in that order (training order);
* a completed sample carries its tokens, loss mask, rollout logprobs and reward, shaped by the
  request's lane (:mod:`engine.projections.lanes`): with ``TeacherScored`` it carries the
  teacher's logprobs, top-K, action and is-teacher masks, and its loss mask becomes the action
  mask; the CE lane gives instead the SFT sub-samples in the rollout's shuffled order
  (``sample_id`` ``<id>/ce<j>``);
* an aborted sample becomes ``Sample.masked_dummy`` keeping its index, group, prompt and the
  agent's own reason; ``RolloutReady.dummy`` gives exactly one masked dummy.

A reward given as a dict of named scores stays a dict on the sample; its scalar is the
``"score"`` entry (:func:`scalar_reward`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import ValidationError

from engine.domain import Task
from engine.errors import ConfigError, RolloutError
from engine.events.arrays import Mask, concat
from engine.events.catalog import SampleAborted, SampleCompleted, TaskFetched, TeacherScored
from engine.projections.lanes import (
    CeChunk,
    CePlan,
    Lane,
    ce_chunks,
    plan_ce,
    request_lane,
    teacher_shape,
)
from engine.projections.readback import Rollout
from engine.projections.rollout import SampleRecord
from engine.sample import Sample

__all__ = [
    "ce_plan",
    "ce_samples",
    "check_terminal",
    "sample_of",
    "samples_named",
    "scalar_reward",
    "task_of",
    "trainer_samples",
]


def scalar_reward(reward: float | Mapping[str, float]) -> float:
    """The number a reward stands for: itself, or a dict's ``"score"`` entry (0 if absent)."""
    if isinstance(reward, Mapping):
        return float(reward.get("score", 0.0))
    return float(reward)


def task_of(ev: TaskFetched) -> Task:
    """The ``Task`` a ``TaskFetched`` stands for (its settings stay on the event)."""
    try:
        return Task(
            sample_id=ev.sample_id,
            rollout_id=ev.rollout_id,
            index=ev.index,
            group_index=ev.group_index,
            prompt=ev.prompt,
            label=ev.label,
            dataset_name=ev.dataset,
            task_type=ev.task_type,
            source_line=ev.source_line if ev.source_line is not None else 1,
            metadata=ev.metadata,
        )
    except ValidationError as exc:
        raise ConfigError(
            f"TaskFetched {ev.sample_id}: not a valid task: "
            f"{exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None


def _metadata(ev: TaskFetched) -> dict[str, Any]:
    if ev.source_line is None:
        return {**ev.metadata, "task_type": ev.task_type, "dataset": ev.dataset}
    return {
        **ev.metadata,
        "_source_line": ev.source_line,
        "task_type": ev.task_type,
        "dataset": ev.dataset,
    }


def sample_of(
    task: TaskFetched,
    terminal: SampleCompleted | SampleAborted | None,
    teacher: TeacherScored | None = None,
    *,
    policy_version: int | None = None,
    lane: Lane = Lane.PLAIN,
) -> Sample:
    """The trainer's view of one sample from its task, first terminal event and teacher
    scoring."""
    done = terminal if isinstance(terminal, SampleCompleted) else None
    if done is None:
        # As ``rows.sample_row``: an abort's class names the reason, the agent's own is kept.
        aborted = terminal if isinstance(terminal, SampleAborted) else None
        dummy = Sample.masked_dummy(
            reason=aborted.abort_class.reason if aborted is not None else None,
            agent_reason=aborted.agent_reason if aborted is not None else None,
            policy_version=policy_version,
        )
        return dummy.model_copy(
            update={
                "index": task.index,
                "group_index": task.group_index,
                "sample_id": task.sample_id,
                "prompt": task.prompt,
                "label": task.label,
                "metadata": {**_metadata(task), **dummy.metadata},
            }
        )
    # The arrays stay packed: the sample takes the event's bytes, no per-token conversion.
    loss_mask = done.loss_mask
    per_token: dict[str, Any] = {}
    if teacher is not None:
        shaped = teacher_shape(done, teacher, lane)
        loss_mask = shaped.loss_mask
        per_token = {
            "teacher_log_probs": shaped.teacher_log_probs,
            "teacher_top_k": shaped.top_k,
            "teacher_topk_ids": shaped.topk_ids,
            "teacher_topk_log_probs": shaped.topk_log_probs,
            "action_mask": shaped.action_mask,
            "is_teacher_mask": shaped.is_teacher_mask,
        }
    reward: float | dict[str, float] = float(done.reward)
    if done.reward_detail:
        reward = {str(k): float(v) for k, v in done.reward_detail.items()}
    metadata = _metadata(task)
    metadata["attempt"] = done.attempt
    metadata["n_turns"] = done.n_turns
    return _sample(
        index=task.index,
        group_index=task.group_index,
        sample_id=task.sample_id,
        prompt=task.prompt,
        response=done.response_text,
        label=task.label,
        tokens=concat([done.prompt_ids, done.response_ids]),
        response_length=len(done.response_ids),
        loss_mask=loss_mask,
        rollout_log_probs=done.logprobs if len(done.logprobs) else None,
        reward=reward,
        status=done.status,
        termination_reason=done.termination_reason,
        policy_version=done.policy_version if policy_version is None else policy_version,
        token_versions=done.token_versions if len(done.token_versions) else None,
        metadata=metadata,
        **per_token,
    )


# ---------------------------------------------------------------- building a Sample cheaply

_FIELDS = tuple(Sample.model_fields)
_DEFAULTS = {
    name: info.default for name, info in Sample.model_fields.items() if not info.is_required()
}
_LINE_UP = Sample.__pydantic_decorators__.model_validators["_arrays_line_up"].func
_new = object.__new__
_set = object.__setattr__


def _plain(value: object) -> bool:
    """A JSON scalar that pydantic's ``JsonValue`` (no inf/nan) keeps as it is."""
    kind = type(value)
    if kind is float:
        return math.isfinite(value)  # type: ignore[arg-type]
    return value is None or kind is str or kind is int or kind is bool


def _score(value: object) -> bool:
    return type(value) is float and math.isfinite(value)


def _sample(**fields: Any) -> Sample:
    """``Sample(**fields)`` without validating again values the events already validated.

    What the events do not constrain as ``Sample`` does is checked here (non-negative int
    counts, a string prompt, flat JSON label and metadata, finite rewards); when it holds,
    validation would return every value unchanged, so only ``_arrays_line_up`` runs. Anything
    else goes through the constructor, which coerces or raises."""
    reward = fields["reward"]
    version = fields["policy_version"]
    ok = (
        type(fields["index"]) is int
        and fields["index"] >= 0
        and type(fields["group_index"]) is int
        and fields["group_index"] >= 0
        and (version is None or (type(version) is int and version >= 0))
        and type(fields.get("teacher_top_k", 0)) is int
        and fields.get("teacher_top_k", 0) >= 0
        and type(fields["prompt"]) is str
        and _plain(fields["label"])
        and (_score(reward) or type(reward) is dict)
    )
    if ok and type(reward) is dict:
        for key, value in reward.items():
            if type(key) is not str or not _score(value):
                ok = False
    if ok:
        for key, value in fields["metadata"].items():
            if type(key) is not str or not _plain(value):
                ok = False
    if not ok:
        return Sample(**fields)
    values = {name: fields[name] if name in fields else _DEFAULTS[name] for name in _FIELDS}
    sample = _new(Sample)
    _set(sample, "__dict__", values)
    _set(sample, "__pydantic_fields_set__", set(fields))
    _set(sample, "__pydantic_extra__", None)
    _set(sample, "__pydantic_private__", None)
    try:
        _LINE_UP(sample)
    except ValueError:
        return Sample(**fields)  # raises the error the constructor always raised
    return sample


def ce_sample(done: SampleCompleted, chunk: CeChunk, parent: Sample) -> Sample:
    """One CE-lane SFT sub-sample of the trajectory ``parent``: the prompt and the first
    ``chunk.end`` response tokens, CE on the teacher's tokens of ``[chunk.start, chunk.end)``."""
    end = chunk.end
    teacher = done.teacher_mask.numpy()[:end]
    loss = np.zeros(end, dtype=np.uint8)
    loss[chunk.start : end] = teacher[chunk.start : end]
    prompt_len = len(done.prompt_ids)
    metadata = {
        **parent.metadata,
        "parent_sample_id": parent.sample_id,
        "ce_chunk": chunk.chunk,
        "ce_start": chunk.start,
    }
    fields = {name: getattr(parent, name) for name in type(parent).model_fields}
    return type(parent)(
        **{
            **fields,
            "sample_id": f"{parent.sample_id}/ce{chunk.chunk}",
            "tokens": parent.tokens[: prompt_len + end],
            "response_length": end,
            "response": "",
            "loss_mask": Mask.from_values(loss),
            "rollout_log_probs": (
                parent.rollout_log_probs[:end] if parent.rollout_log_probs is not None else None
            ),
            "token_versions": (
                parent.token_versions[:end] if parent.token_versions is not None else None
            ),
            "is_teacher_mask": Mask.from_values(np.ascontiguousarray(teacher)),
            "metadata": metadata,
        }
    )


def trainer_samples(rollout: Rollout) -> list[Sample]:
    """The samples ``RolloutReady`` names, in its order; raises ``RolloutError`` if the
    rollout is not ready or names a sample with no terminal event."""
    state = rollout.state
    ready = state.ready
    if ready is None:
        raise RolloutError(f"rollout {state.rollout_id} has no RolloutReady yet")
    if ready.dummy:
        return [Sample.masked_dummy(policy_version=ready.policy_version)]
    ids = ready.sample_ids
    lane = request_lane(state.request)
    if lane is not Lane.CE:
        return samples_named(rollout, ids, lane)
    check_terminal(state.samples, state.rollout_id, ids)
    # SFT sub-samples are shuffled across the whole rollout, so they are planned first.
    chunks = ce_plan(rollout, ids).chunks
    if not chunks:
        return [Sample.masked_dummy(policy_version=ready.policy_version)]
    return ce_samples(rollout, chunks)


def ce_plan(rollout: Rollout, kept: Sequence[str]) -> CePlan:
    """The CE plan of the kept completed samples (aborted ones have no trajectory): a
    trajectory whose chunks include one over ``max_seq_len`` is dropped whole."""

    def expanded() -> Iterator[tuple[str, Sequence[CeChunk]]]:
        for sid in kept:
            r = rollout.record(sid)
            if r is not None and r.completed:
                yield sid, ce_chunks(rollout.completed(r))

    return plan_ce(rollout.state.request, expanded())


def ce_samples(rollout: Rollout, chunks: Sequence[CeChunk]) -> list[Sample]:
    """The SFT sub-samples of a CE plan's ``chunks``, in order, each parent built once."""
    parents: dict[str, tuple[SampleCompleted, Sample]] = {}
    out: list[Sample] = []
    for c in chunks:
        built = parents.get(c.sample_id)
        if built is None:
            r = rollout.record(c.sample_id)
            assert r is not None
            done = rollout.completed(r)
            parent = sample_of(rollout.task(r), done, rollout.teacher(r))
            built = parents[c.sample_id] = (done, parent)
        out.append(ce_sample(built[0], c, built[1]))
    return out


def samples_named(rollout: Rollout, ids: Sequence[str], lane: Lane) -> list[Sample]:
    """The samples of ``ids``, in that order, shaped by ``lane`` (not CE); a stale one the
    ready rollout kept (``keep`` policy) as :meth:`Sample.as_stale`; raises naming the first
    id with no terminal event, before building any."""
    samples = rollout.state.samples
    check_terminal(samples, rollout.state.rollout_id, ids)
    ready = rollout.state.ready
    stale = set(ready.stale_sample_ids) if ready is not None else set()
    out: list[Sample] = []
    for sample_id in ids:
        r = samples[sample_id]
        built = sample_of(rollout.task(r), rollout.terminal(r), rollout.teacher(r), lane=lane)
        out.append(built.as_stale() if sample_id in stale else built)
    return out


def check_terminal(
    samples: Mapping[str, SampleRecord], rollout_id: str | None, ids: Sequence[str]
) -> None:
    """Raise naming the first of ``ids`` that has no terminal event."""
    for sample_id in ids:
        r = samples.get(sample_id)
        if r is None or not r.done:
            raise RolloutError(
                f"rollout {rollout_id}: RolloutReady names {sample_id}, which has no terminal "
                f"event in the stream"
            )
