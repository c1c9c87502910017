"""Batch composition, evaluator-profile resolution and the generation-settings cascade.

Batching is the scheduler's one pluggable decision: a ``BatchingStrategy`` is any callable
``(tasks, profiles) -> batches``; everything downstream treats batches uniformly. A strategy must
place every task in exactly one batch, keep a batch to one task type, and derive batch ids
from data (``batch_id_for``) so a replayed scheduler produces the same ids.

``fifo_batching`` (the default) groups tasks by task type in encounter order and seals a batch
when it reaches the matching profile's ``batch_size``; the next task of that type opens a new
batch. A type without a profile, or a profile with ``batch_size=None``, keeps one open batch. A
batch's id is ``batch_id_for(rollout_id, index of its first task)``: unique within the rollout
because each task lands in one batch, and independent of how the scheduler chunked its fetches.

Generation settings resolve through three levels, field by field, the finest set value winning:
flags (coarsest) -> ``EvaluatorProfile`` defaults -> the dataset's overrides (finest). The
planner resolves them once per (evaluator, dataset) and writes the result into each sample's
``TaskFetched``; nothing downstream resolves them again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from engine.domain import (
    Batch,
    DatasetConfig,
    EvaluatorProfile,
    SamplingParams,
    StoppingCriteria,
    Task,
    batch_id_for,
    overlay,
)
from engine.errors import ConfigError

__all__ = [
    "BatchingStrategy",
    "fifo_batching",
    "resolve_sampling_params",
    "resolve_profile",
    "resolve_stopping",
]

logger = logging.getLogger(__name__)

BatchingStrategy = Callable[[list[Task], Mapping[str, EvaluatorProfile]], list[Batch]]


def fifo_batching(tasks: list[Task], profiles: Mapping[str, EvaluatorProfile]) -> list[Batch]:
    """Group by task type in encounter order, sealing at the profile's ``batch_size``."""
    groups: list[list[Task]] = []
    open_groups: dict[str, list[Task]] = {}
    for task in tasks:
        task_type = task.task_type
        profile = profiles.get(task_type)
        batch_size = profile.batch_size if profile is not None else None
        group = open_groups.get(task_type)
        if group is None:
            group = open_groups[task_type] = []
            groups.append(group)
        group.append(task)
        if batch_size is not None and len(group) >= batch_size:
            del open_groups[task_type]
    return [
        Batch(
            batch_id=batch_id_for(group[0].rollout_id, group[0].index),
            task_type=group[0].task_type,
            tasks=tuple(group),
        )
        for group in groups
    ]


def resolve_profile(
    task_type: str, profiles: Mapping[str, EvaluatorProfile]
) -> EvaluatorProfile:
    """The profile whose ``evaluator_id`` is ``task_type``; else, with a warning, the first."""
    profile = profiles.get(task_type)
    if profile is not None:
        return profile
    if not profiles:
        raise ConfigError(f"no evaluator profiles to run task type {task_type!r}")
    fallback = next(iter(profiles.values()))
    logger.warning(
        "no evaluator with id %r (known: %s); running its tasks with %r",
        task_type,
        ", ".join(profiles),
        fallback.evaluator_id,
    )
    return fallback


def resolve_stopping(
    flags: StoppingCriteria, profile: EvaluatorProfile, dataset: DatasetConfig
) -> StoppingCriteria:
    """Stopping criteria for a sample: dataset over profile default over flags, per field."""
    return overlay(overlay(flags, profile.default_stopping), dataset.stopping)


def resolve_sampling_params(
    flags: SamplingParams, profile: EvaluatorProfile, dataset: DatasetConfig
) -> SamplingParams:
    """Sampling params for a sample: dataset over profile default over flags, per field."""
    return overlay(overlay(flags, profile.default_sampling_params), dataset.sampling_params)
