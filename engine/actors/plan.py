"""A rollout's plan: the events it writes, in order, built a range at a time."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.domain import SamplingParams, StoppingCriteria, Task
from engine.events.base import Event
from engine.events.catalog import (
    BatchSealed,
    DataCursorAdvanced,
    RolloutPlanned,
    RolloutRequested,
    TaskFetched,
    TaskJoined,
)

__all__ = ["Plan", "join_maker", "task_maker"]

# A task's fields that become a TaskFetched's group fields (catalog.GROUP_FIELDS; the
# rollout id, the resolved settings -- per dataset -- and carried_from follow from them).
_TASK_GROUP_FIELDS = ("prompt", "label", "dataset_name", "task_type", "source_line", "metadata")


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a rollout's plan writes, in the order it is written.

    The ``TaskFetched`` events are built on demand, a range at a time
    (``rollout_events(start, stop)``): a 100k-sample plan is written in chunks and never
    holds all of its encoded-to-be events at once, which keeps planning linear.
    """

    request: RolloutRequested
    cursor: DataCursorAdvanced
    sample_ids: tuple[str, ...]
    batches: tuple[BatchSealed, ...]
    planned: RolloutPlanned
    make_tasks: Callable[[int, int], list[TaskFetched]] = field(repr=False, compare=False)
    # Per group index, the position (in ``tasks()``) of the group's first sample: the one
    # whose ``TaskFetched`` the others' ``TaskJoined`` refer to (empty: none written joined).
    group_first: Mapping[int, int] = field(default_factory=dict, repr=False, compare=False)
    # Sample ``at``'s TaskJoined when the planner's own tasks show it shares every group
    # field with its group's first sample, built without its TaskFetched; None: not known
    # so (a group's first, a carried sample, a field that differs), and ``wire_tasks``
    # compares the events themselves.
    make_joined: Callable[[int], TaskJoined | None] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def rollout_id(self) -> str:
        return self.request.rollout_id

    @property
    def n_events(self) -> int:
        """Events of ``rl:{rollout:<id>}``: the request copy, tasks, batches, the marker."""
        return len(self.sample_ids) + len(self.batches) + 2

    def tasks(self, start: int = 0, stop: int | None = None) -> list[TaskFetched]:
        """``TaskFetched`` of samples ``start`` to ``stop`` (index order)."""
        n = len(self.sample_ids)
        return self.make_tasks(min(start, n), n if stop is None else min(stop, n))

    def wire_tasks(self, start: int = 0, stop: int | None = None) -> list[Event]:
        """What the stream holds for samples ``start`` to ``stop``: the ``TaskFetched`` of a
        group's first sample, and a ``TaskJoined`` on it for every other sample of the group
        that shares its task (a sample that differs in any group field is written whole).

        A joined sample of the planner's own tasks is built from its task (``make_joined``)
        without its ``TaskFetched``; every other sample's ``TaskFetched`` is built and
        compared with its group's first as ``TaskJoined.of`` compares them."""
        n = len(self.sample_ids)
        lo = max(min(start, n), 0)
        hi = n if stop is None else max(min(stop, n), lo)
        joined_of = self.make_joined
        out: list[Event | None] = (
            [joined_of(at) for at in range(lo, hi)] if joined_of is not None else [None] * (hi - lo)
        )
        built: dict[int, TaskFetched] = {}

        def task(at: int) -> TaskFetched:
            ev = built.get(at)
            if ev is None:
                ev = built[at] = self.make_tasks(at, at + 1)[0]
            return ev

        for at in range(lo, hi):
            if out[at - lo] is not None:
                continue
            ev = task(at)
            pos = self.group_first.get(ev.group_index)
            joined = None if pos is None or pos == at else TaskJoined.of(ev, task(pos))
            out[at - lo] = ev if joined is None else joined
        return [ev for ev in out if ev is not None]

    def rollout_events(self, start: int = 0, stop: int | None = None) -> list[Event]:
        """Events ``start`` to ``stop`` of ``rl:{rollout:<id>}``, in stream order."""
        n, m = len(self.sample_ids), len(self.batches)
        stop = self.n_events if stop is None else min(stop, self.n_events)
        out: list[Event] = []
        if start <= 0 < stop:
            out.append(self.request)
        if start < n + 1 and stop > 1:
            out.extend(self.wire_tasks(max(start, 1) - 1, stop - 1))
        if start < n + m + 1 and stop > n + 1:
            out.extend(self.batches[max(start - n - 1, 0) : stop - n - 1])
        if start <= n + m + 1 < stop:
            out.append(self.planned)
        return out

    def largest_batches(self) -> dict[str, int]:
        """Per evaluator id, the sample count of its biggest batch (for the deadlock check)."""
        out: dict[str, int] = {}
        for batch in self.batches:
            out[batch.evaluator_id] = max(out.get(batch.evaluator_id, 0), len(batch.sample_ids))
        return out


_new = object.__new__
_set = object.__setattr__
# What TaskJoined.of passes: every field but the type (producer and causation are the
# TaskFetched's defaults, "" and None).
_JOINED_SET = frozenset(TaskJoined.model_fields) - {"type"}


def _joined(rid: str, sample_id: str, index: int, group_index: int, same_as: str) -> TaskJoined:
    """``TaskJoined(rollout_id=rid, ..., same_as=same_as, producer="", causation=None)``,
    the arguments ``TaskJoined.of`` passes, for a plan's hot loop (a joined sample is most
    of a rollout). The values come validated (the request's id, the task's own), so when
    each has its field's exact type the instance is filled in without the validator --
    equal to the validated one, field order and fields set included; anything else is
    validated."""
    if (
        type(rid) is not str
        or type(sample_id) is not str
        or type(index) is not int
        or type(group_index) is not int
        or type(same_as) is not str
    ):
        return TaskJoined(
            rollout_id=rid,
            sample_id=sample_id,
            index=index,
            group_index=group_index,
            same_as=same_as,
            producer="",
            causation=None,
        )
    ev = _new(TaskJoined)
    _set(
        ev,
        "__dict__",
        {
            "type": "TaskJoined",
            "producer": "",
            "causation": None,
            "rollout_id": rid,
            "sample_id": sample_id,
            "index": index,
            "group_index": group_index,
            "same_as": same_as,
        },
    )
    _set(ev, "__pydantic_fields_set__", set(_JOINED_SET))
    _set(ev, "__pydantic_extra__", None)
    _set(ev, "__pydantic_private__", None)
    return ev


def task_maker(
    rid: str,
    tasks: list[Task],
    resolved: Mapping[str, tuple[StoppingCriteria, SamplingParams]],
    carried: Sequence[TaskFetched],
) -> Callable[[int, int], list[TaskFetched]]:
    """The ``TaskFetched`` of positions ``[start, stop)``: planned tasks, then carried ones."""

    def make_tasks(start: int, stop: int) -> list[TaskFetched]:
        out = [
            TaskFetched(
                rollout_id=rid,
                sample_id=task.sample_id,
                index=task.index,
                group_index=task.group_index,
                prompt=task.prompt,
                label=task.label,
                dataset=task.dataset_name,
                task_type=task.task_type,
                source_line=task.source_line,
                metadata=task.metadata,
                stopping=resolved[task.dataset_name][0],
                sampling_params=resolved[task.dataset_name][1],
            )
            for task in tasks[start:stop]
        ]
        n = len(tasks)
        out.extend(carried[max(start - n, 0) : max(stop - n, 0)])
        return out

    return make_tasks


def join_maker(
    rid: str, tasks: list[Task], group_first: Mapping[int, int]
) -> Callable[[int], TaskJoined | None]:
    """The ``TaskJoined`` of position ``at``, or None when its task is not its group's.

    Read from the tasks: a TaskFetched holds a task's group fields as they are (JSON values as
    given, the metadata copied, the resolved settings shared per dataset), so fields equal here
    are equal there, and ``TaskJoined.of`` would join."""

    def make_joined(at: int) -> TaskJoined | None:
        if at >= len(tasks):
            return None  # a carried sample: its TaskFetched is compared
        task = tasks[at]
        pos = group_first.get(task.group_index)
        if pos is None or pos == at or pos >= len(tasks):
            return None
        first = tasks[pos]
        if task.sample_id == first.sample_id:
            return None
        for name in _TASK_GROUP_FIELDS:
            mine, theirs = getattr(task, name), getattr(first, name)
            if mine is not theirs and mine != theirs:
                return None
        return _joined(rid, task.sample_id, task.index, task.group_index, first.sample_id)

    return make_joined
