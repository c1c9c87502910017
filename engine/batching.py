"""Batch composition, evaluator-spec resolution and the generation-settings cascade.

Batching is the scheduler's one pluggable decision: a ``BatchingStrategy`` is any callable
``(tasks, specs) -> batches``; everything downstream treats batches uniformly. A strategy must
place every task in exactly one batch, keep a batch to one task type, and derive batch ids
from data (``batch_id_for``) so a replayed scheduler produces the same ids.

``fifo_batching`` (the default) groups tasks by task type in encounter order and seals a batch
when it reaches the matching spec's ``batch_size``; the next task of that type opens a new
batch. A type without a spec, or a spec with ``batch_size=None``, keeps one open batch. A
batch's id is ``batch_id_for(rollout_id, index of its first task)``: unique within the rollout
because each task lands in one batch, and independent of how the scheduler chunked its fetches.

Generation settings resolve through three levels, field by field, the finest set value winning:
flags (coarsest) -> ``EvaluatorSpec`` defaults -> the dataset's overrides (finest).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from engine.domain import (
    Batch,
    DatasetConfig,
    EvaluatorSpec,
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
    "resolve_spec",
    "resolve_stopping",
]

logger = logging.getLogger(__name__)

BatchingStrategy = Callable[[list[Task], Mapping[str, EvaluatorSpec]], list[Batch]]


def fifo_batching(tasks: list[Task], specs: Mapping[str, EvaluatorSpec]) -> list[Batch]:
    """Group by task type in encounter order, sealing at the spec's ``batch_size``."""
    groups: list[list[Task]] = []
    open_groups: dict[str, list[Task]] = {}
    for task in tasks:
        task_type = task.task_type
        spec = specs.get(task_type)
        batch_size = spec.batch_size if spec is not None else None
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


def resolve_spec(task_type: str, specs: Mapping[str, EvaluatorSpec]) -> EvaluatorSpec:
    """The spec whose ``evaluator_id`` is ``task_type``; else, with a warning, the first spec."""
    spec = specs.get(task_type)
    if spec is not None:
        return spec
    if not specs:
        raise ConfigError(f"no evaluator specs to run task type {task_type!r}")
    fallback = next(iter(specs.values()))
    logger.warning(
        "no evaluator with id %r (known: %s); running its tasks with %r",
        task_type,
        ", ".join(specs),
        fallback.evaluator_id,
    )
    return fallback


def resolve_stopping(
    flags: StoppingCriteria, spec: EvaluatorSpec, dataset: DatasetConfig
) -> StoppingCriteria:
    """Stopping criteria for a sample: dataset over spec default over flags, per field."""
    return overlay(overlay(flags, spec.default_stopping), dataset.stopping)


def resolve_sampling_params(
    flags: SamplingParams, spec: EvaluatorSpec, dataset: DatasetConfig
) -> SamplingParams:
    """Sampling params for a sample: dataset over spec default over flags, per field."""
    return overlay(overlay(flags, spec.default_sampling_params), dataset.sampling_params)
