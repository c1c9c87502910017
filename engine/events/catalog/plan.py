"""The plan of a rollout on its stream: one task per sample, batches, the plan's end."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from engine.domain import SamplingParams, StoppingCriteria
from engine.events.base import Event, upcaster
from engine.events.catalog.records import JSON


class TaskFetched(Event):
    """One sample's task: prompt, label, dataset, task type, group, and the generation
    settings the planner resolved for it.

    ``stopping`` / ``sampling_params`` are final: the planner applied the cascade (request ->
    evaluator profile -> dataset) and nothing downstream applies it again. ``source_line`` is
    the prompt's 1-based line in the dataset file (``None``: not recorded). The request's
    knobs are not copied here: they travel once per rollout, in the ``RolloutRequested``
    copy that opens the rollout stream.
    """

    schema_version: ClassVar[int] = 2

    type: Literal["TaskFetched"] = "TaskFetched"
    rollout_id: str
    sample_id: str
    index: int
    group_index: int
    prompt: JSON
    label: JSON = None
    dataset: str
    task_type: str
    source_line: int | None = None
    metadata: dict[str, JSON] = Field(default_factory=dict)
    stopping: StoppingCriteria = StoppingCriteria()
    sampling_params: SamplingParams = SamplingParams()
    # A sample carried over from an earlier rollout's tail (``tail="carry"``): the
    # rollout it runs in, whose stream holds its lifecycle events; its ``sample_id`` is that
    # rollout's. None: a sample of this rollout.
    carried_from: str | None = None


@upcaster("TaskFetched", 1)
def _task_fetched_v1(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 also holds the dataset's config (``dataset_cfg``) and the request's ``knobs``:
    # dropped. Its line number is ``metadata["_source_line"]``: moved into ``source_line``
    # (a sample's metadata still shows it as ``_source_line``, see ``projections.samples``).
    payload.pop("dataset_cfg", None)
    payload.pop("knobs", None)
    metadata = payload.get("metadata")
    if isinstance(metadata, dict):
        line = metadata.get("_source_line")
        # Only a line number moves; anything else stays in the metadata it was written to.
        if isinstance(line, int) and not isinstance(line, bool) and line >= 1:
            payload["metadata"] = {k: v for k, v in metadata.items() if k != "_source_line"}
            payload["source_line"] = line
    return payload


# The fields a group's samples share: a TaskJoined takes them from its group's TaskFetched.
GROUP_FIELDS = (
    "rollout_id",
    "prompt",
    "label",
    "dataset",
    "task_type",
    "source_line",
    "metadata",
    "stopping",
    "sampling_params",
    "carried_from",
)


_new = object.__new__
_set = object.__setattr__
_JOINED_SET = frozenset({"sample_id", "index", "group_index", "producer", "causation"})


class TaskJoined(Event):
    """A sample whose task is its group's: the group's prompt is stored once.

    The n samples of a group share their prompt, label, dataset, task type, source line,
    metadata and resolved settings; the planner writes them once, in the group's first
    ``TaskFetched`` (``same_as``, its sample id, earlier in the same stream), and every other
    sample of the group as this event, which carries only what is the sample's own. Readers
    never see it as a task: the rollout fold and the workers' task readers turn it into the
    ``TaskFetched`` it stands for (:meth:`task`), so every consumer sees a whole task per
    sample. A ``TaskJoined`` whose ``same_as`` the
    stream does not hold is a writer's error, named where it is folded."""

    type: Literal["TaskJoined"] = "TaskJoined"
    rollout_id: str
    sample_id: str
    index: int
    group_index: int
    same_as: str

    def task(self, first: TaskFetched) -> TaskFetched:
        """The ``TaskFetched`` this sample stands for: ``first``'s task with this sample's
        ids (and this event's producer and causation).

        Built the way ``model_copy(update=...)`` builds it (every value is already validated,
        in ``first`` or here), without its generic copy: a fold turns every joined sample of
        a rollout into its task, so this is on the finalizer's and the workers' hot path."""
        values = dict(first.__dict__)
        values["sample_id"] = self.sample_id
        values["index"] = self.index
        values["group_index"] = self.group_index
        values["producer"] = self.producer
        values["causation"] = self.causation
        task = _new(TaskFetched)
        _set(task, "__dict__", values)
        _set(task, "__pydantic_fields_set__", first.__pydantic_fields_set__ | _JOINED_SET)
        _set(task, "__pydantic_extra__", None)
        _set(task, "__pydantic_private__", None)
        return task

    @classmethod
    def of(cls, ev: TaskFetched, first: TaskFetched) -> TaskJoined | None:
        """``ev`` as a ``TaskJoined`` on ``first`` when that loses nothing (it shares every
        group field with ``first``), else None (``ev`` is then written whole)."""
        if ev.group_index != first.group_index or ev.sample_id == first.sample_id:
            return None
        mine, theirs = ev.__dict__, first.__dict__
        for name in GROUP_FIELDS:
            if mine[name] is not theirs[name] and mine[name] != theirs[name]:
                return None
        # The validating constructor, not model_construct: pydantic-core checks these few
        # fields in less time than model_construct takes to fill them in (1.2 vs 3.3 us).
        return cls(
            rollout_id=ev.rollout_id,
            sample_id=ev.sample_id,
            index=ev.index,
            group_index=ev.group_index,
            same_as=first.sample_id,
            producer=ev.producer,
            causation=ev.causation,
        )


class BatchSealed(Event):
    """The batching strategy's output: which samples run together, in what order."""

    type: Literal["BatchSealed"] = "BatchSealed"
    rollout_id: str
    batch_id: str
    seq: int
    evaluator_id: str
    sample_ids: list[str]


class RolloutPlanned(Event):
    """Written after every ``TaskFetched`` and ``BatchSealed`` of the rollout: the plan is
    complete, and the rollout is finished when ``n_samples`` samples are terminal."""

    type: Literal["RolloutPlanned"] = "RolloutPlanned"
    rollout_id: str
    n_samples: int
    n_batches: int
    batch_ids: list[str] = Field(default_factory=list)
