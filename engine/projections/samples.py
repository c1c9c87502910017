"""From events to the domain: a ``TaskFetched`` to its ``Task``, and a finished rollout's
state to the trainer's ``Sample`` list.

``trainer_samples(state)`` is the one way samples are rebuilt from the log: the trainer
client's ``load`` (on the lean fold of :mod:`engine.projections.loading`) and ``rollout
replay`` both call it, so they agree by construction; ``iter_load`` builds each chunk with
:func:`samples_named`, the same per-sample path.
``trainer_sample_chunks(state, n)`` yields the same samples, in the same order, ``n`` at a
time, letting go of each sample's folded events as it goes (for a caller that holds a whole
fold already; ``RolloutClient.iter_load`` streams from the log instead).

* The samples are those ``RolloutReady.sample_ids`` names, in that order (training order).
* A completed sample carries its prompt + response tokens, loss mask, rollout logprobs and
  reward, shaped by the request's lane (:mod:`engine.projections.lanes`): with teacher
  logprobs captured (``TeacherScored``, the per-token lanes) it carries ``teacher_log_probs``,
  the teacher's top-K ids and logprobs, the action mask and the is-teacher mask, and its
  ``loss_mask`` becomes the action mask (inference-backend §3 role B: the loss sees exactly
  the student-emitted tokens); the mixed lane writes the +1.0 sentinel at teacher positions
  and trains those too. The CE lane gives, instead of the trajectories, their SFT
  sub-samples in the iteration's shuffled order (``sample_id`` ``<id>/ce<j>``).
* An aborted sample becomes ``Sample.masked_dummy`` (two zero tokens, zero loss mask,
  ``remove_sample``, reward 0) keeping its index, group, prompt and the agent's own reason.
* ``RolloutReady.dummy`` (filters emptied the rollout) gives exactly one masked dummy.

A reward given as a dict of named scores keeps the dict on the sample; its scalar (for
``SampleCompleted.reward`` and collation) is the ``"score"`` entry (:func:`scalar_reward`).
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
from engine.events.catalog import SampleAborted, SampleCompleted, TaskFetched
from engine.projections.lanes import CeChunk, Lane, ce_plan, request_lane, teacher_shape
from engine.projections.rollout import RolloutState, SampleState
from engine.sample import Sample

__all__ = [
    "ce_samples",
    "no_terminal",
    "sample_of",
    "samples_named",
    "trainer_sample_chunks",
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
    """A sample's metadata: the dataset's metadata keys, the prompt's line (as
    ``_source_line``, where it always was), its task type and dataset."""
    if ev.source_line is None:
        return {**ev.metadata, "task_type": ev.task_type, "dataset": ev.dataset}
    return {
        **ev.metadata,
        "_source_line": ev.source_line,
        "task_type": ev.task_type,
        "dataset": ev.dataset,
    }


def sample_of(
    s: SampleState, *, policy_version: int | None = None, lane: Lane = Lane.PLAIN
) -> Sample:
    """The trainer's view of one terminal sample (see the module docstring)."""
    task = s.task
    terminal = s.terminal
    done = terminal if isinstance(terminal, SampleCompleted) else None
    if done is None:
        # Identity and outcome as the sample's row (``rows.sample_row``) has them: an abort's
        # class names the reason, the agent's own reason is kept; a sample with no terminal
        # event has neither.
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
    if s.teacher is not None:
        shaped = teacher_shape(done, s.teacher, lane)
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
    """``Sample(**fields)`` without running pydantic again over values validated on their
    way in (validating a rollout's samples field by field was a third of its load).

    ``sample_of`` passes the event's arrays (the exact packed classes), enums and strings,
    which validation returns unchanged; what the events do not constrain as ``Sample``
    does is checked here: counts >= 0 that are ints (not bools), a string prompt, a flat
    JSON label and metadata, finite rewards. When those hold, validation would return every
    value unchanged, so the sample is built from them directly and only the model's own
    invariants run (``_arrays_line_up``). Anything else -- or an invariant that fails --
    goes through the constructor, which coerces or raises exactly as it always did."""
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


def ce_sample(s: SampleState, chunk: CeChunk, parent: Sample | None = None) -> Sample:
    """One SFT sub-sample of a completed trajectory (the CE lane; see
    :func:`engine.projections.lanes.ce_chunks`): the prompt and the first ``chunk.end``
    response tokens, CE on the teacher's tokens of ``[chunk.start, chunk.end)``.
    ``parent`` is ``sample_of(s)`` when the caller has it already."""
    parent = parent if parent is not None else sample_of(s)
    done = s.completed
    assert done is not None
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


def trainer_samples(state: RolloutState) -> list[Sample]:
    """The samples ``RolloutReady`` names, in its order; raises if the rollout is not ready."""
    return [s for chunk in _chunks(state, None, consume=False) for s in chunk]


def trainer_sample_chunks(state: RolloutState, chunk_size: int) -> Iterator[list[Sample]]:
    """:func:`trainer_samples` in lists of ``chunk_size`` (the last may be shorter).

    It consumes ``state``: each sample's folded events are dropped from ``state.samples``
    once its ``Sample`` is built, so a caller that lets go of each chunk holds one chunk of
    samples, never the whole rollout twice. Raises as :func:`trainer_samples` does, before
    the chunk that names a sample with no terminal event.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    return _chunks(state, chunk_size, consume=True)


def _chunks(state: RolloutState, size: int | None, *, consume: bool) -> Iterator[list[Sample]]:
    ready = state.ready
    if ready is None:
        raise RolloutError(f"rollout {state.rollout_id} has no RolloutReady yet")
    if ready.dummy:
        yield [Sample.masked_dummy(policy_version=ready.policy_version)]
        return
    ids = ready.sample_ids
    step = size or max(1, len(ids))
    lane = request_lane(state.request)
    if lane is Lane.CE:
        # The SFT sub-samples are shuffled across the whole rollout, so the lane builds them
        # all (each parent once), then hands them out in chunks.
        for sample_id in ids:
            _check_terminal(state, sample_id)
        chunks = ce_samples(state, ce_plan(state, ids).chunks)
        if not chunks:
            yield [Sample.masked_dummy(policy_version=ready.policy_version)]
            return
        for at in range(0, len(chunks), size or len(chunks)):
            yield chunks[at : at + (size or len(chunks))]
        return
    for at in range(0, len(ids), step):
        part = ids[at : at + step]
        if consume:
            for sample_id in part:
                _check_terminal(state, sample_id)
            yield [sample_of(state.samples.pop(sample_id), lane=lane) for sample_id in part]
        else:
            yield samples_named(state, part, lane)


def ce_samples(state: RolloutState, chunks: Sequence[CeChunk]) -> list[Sample]:
    """The SFT sub-samples of ``chunks`` (a CE plan's, in its order), each parent trajectory
    built once; ``state`` holds at least their parents."""
    parents: dict[str, Sample] = {}
    out: list[Sample] = []
    for c in chunks:
        s = state.samples[c.sample_id]
        parent = parents.get(c.sample_id)
        if parent is None:
            parent = parents[c.sample_id] = sample_of(s)
        out.append(ce_sample(s, c, parent))
    return out


def samples_named(state: RolloutState, ids: Sequence[str], lane: Lane) -> list[Sample]:
    """The samples of ``ids``, in that order, shaped by ``lane`` (not the CE lane, whose
    sub-samples are planned over the whole rollout); raises naming the first id that has no
    terminal event in ``state``, before building any."""
    for sample_id in ids:
        _check_terminal(state, sample_id)
    samples = state.samples
    return [sample_of(samples[sample_id], lane=lane) for sample_id in ids]


def _check_terminal(state: RolloutState, sample_id: str) -> None:
    s = state.samples.get(sample_id)
    if s is None or not s.done:
        raise no_terminal(state.rollout_id, sample_id)


def no_terminal(rollout_id: str | None, sample_id: str) -> RolloutError:
    """The error of a ready event that names a sample with no terminal event."""
    return RolloutError(
        f"rollout {rollout_id}: RolloutReady names {sample_id}, which has no terminal event "
        f"in the stream"
    )
