"""From events to the domain: a ``TaskFetched`` to its ``Task``, and a finished rollout's
state to the trainer's ``Sample`` list.

``trainer_samples(state)`` is the one way samples are rebuilt from the log: the trainer
client's ``load`` and ``rollout replay`` both call it, so they agree by construction.
``trainer_sample_chunks(state, n)`` yields the same samples, in the same order, ``n`` at a
time, letting go of each sample's folded events as it goes (``RolloutClient.iter_load``).

* The samples are those ``RolloutReady.sample_ids`` names, in that order (training order).
* A completed sample carries its prompt + response tokens, loss mask, rollout logprobs and
  reward. When the rollout's algorithm captured teacher logprobs (``TeacherScored``), the
  sample carries ``teacher_log_probs`` and its ``loss_mask`` becomes the action mask
  (inference-backend §3 role B: the loss sees exactly the student-emitted tokens).
* An aborted sample becomes ``Sample.masked_dummy`` (two zero tokens, zero loss mask,
  ``remove_sample``, reward 0) keeping its index, group, prompt and the agent's own reason.
* ``RolloutReady.dummy`` (filters emptied the rollout) gives exactly one masked dummy.

A reward given as a dict of named scores keeps the dict on the sample; its scalar (for
``SampleCompleted.reward`` and collation) is the ``"score"`` entry (:func:`scalar_reward`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from engine.domain import Task
from engine.errors import ConfigError, RolloutError
from engine.events.arrays import LogProbs, concat
from engine.events.catalog import TaskFetched
from engine.projections.rollout import RolloutState, SampleState
from engine.projections.rows import row_of
from engine.sample import Sample

__all__ = [
    "sample_of",
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


def sample_of(s: SampleState, *, policy_version: int | None = None) -> Sample:
    """The trainer's view of one terminal sample (see the module docstring)."""
    task = s.task
    row = row_of(s)  # identity and outcome, as the summaries see them
    done = s.completed
    if done is None:
        dummy = Sample.masked_dummy(
            reason=row.termination_reason,
            agent_reason=row.agent_reason,
            policy_version=policy_version,
        )
        return dummy.model_copy(
            update={
                "index": row.index,
                "group_index": row.group_index,
                "sample_id": row.sample_id,
                "prompt": task.prompt,
                "label": task.label,
                "metadata": {**_metadata(task), **dummy.metadata},
            }
        )
    # The arrays stay packed: the sample takes the event's bytes, no per-token conversion.
    loss_mask = done.loss_mask
    teacher: LogProbs | None = None
    if s.teacher is not None:
        teacher = s.teacher.teacher_logprobs
        if len(s.teacher.action_mask):
            loss_mask = s.teacher.action_mask
    reward: float | dict[str, float] = float(done.reward)
    if done.reward_detail:
        reward = {str(k): float(v) for k, v in done.reward_detail.items()}
    metadata = _metadata(task)
    metadata["attempt"] = done.attempt
    metadata["n_turns"] = done.n_turns
    return Sample(
        index=row.index,
        group_index=row.group_index,
        sample_id=row.sample_id,
        prompt=task.prompt,
        response=done.response_text,
        label=task.label,
        tokens=concat([done.prompt_ids, done.response_ids]),
        response_length=len(done.response_ids),
        loss_mask=loss_mask,
        rollout_log_probs=done.logprobs if len(done.logprobs) else None,
        teacher_log_probs=teacher,
        reward=reward,
        status=row.status,
        termination_reason=row.termination_reason,
        policy_version=done.policy_version if policy_version is None else policy_version,
        token_versions=done.token_versions if len(done.token_versions) else None,
        metadata=metadata,
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
    for at in range(0, len(ids), step):
        part = ids[at : at + step]
        for sample_id in part:
            s = state.samples.get(sample_id)
            if s is None or not s.done:
                raise RolloutError(
                    f"rollout {state.rollout_id}: RolloutReady names {sample_id}, which has no "
                    f"terminal event in the stream"
                )
        if consume:
            yield [sample_of(state.samples.pop(sample_id)) for sample_id in part]
        else:
            yield [sample_of(state.samples[sample_id]) for sample_id in part]
