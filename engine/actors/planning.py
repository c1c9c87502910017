"""Planning a rollout: the scheduler's pure core, from a ``RolloutRequested`` to its plan.

``Planner.plan(request, data)`` decides everything the scheduler writes before admission:

* **fetch**: a training request takes ``n_prompts`` prompts (``ceil(n_prompts *
  overprovision)`` for an over-provisioned request) from a ``MultiDataSource`` over
  the configured training datasets (or the subset named in ``request.datasets``), starting at
  the cursor folded from ``rl:data`` for that dataset set, or, for the first rollout over it,
  at ``source.start(request.seed)``: the shuffle seed comes from the request, never from
  global randomness, and later rollouts continue the recorded cursor exactly. An eval
  request runs every prompt of the eval datasets (or those named; ``n_prompts`` is not used,
  ``max_prompts`` per dataset is), interleaved round-robin across datasets, and never moves a
  training cursor. ``request.n_samples_per_prompt`` overrides the datasets' group size
  (``n_samples_per_prompt`` / ``n_samples_per_eval_prompt``).
* **distribute / batch**: groups are expanded to samples with ids
  ``engine.domain.sample_id_for(rollout_id, index)`` and batched by the ``BatchingStrategy``
  (default ``fifo_batching``); each batch's evaluator is ``resolve_profile(task_type)``.
* **cascade**: stopping criteria and sampling params resolve field by field from the
  request's ``stopping`` / ``sampling_params`` (the coarsest level, where the seed has CLI
  flags: a dataset or evaluator default overrides them) through the evaluator profile's
  defaults to the dataset's own values (finest, wins). This is the only place the cascade is
  applied: each ``TaskFetched`` carries its sample's resolved ``StoppingCriteria`` and
  ``SamplingParams``, computed once per (evaluator, dataset) and shared by its samples. The
  request's knobs are not copied into the samples; workers read them from the request copy.

The plan's events, in stream order, are the copy of the request, one ``TaskFetched`` per
sample (index order), one ``BatchSealed`` per batch (``seq`` order) and ``RolloutPlanned``;
``cursor`` is the ``DataCursorAdvanced`` for ``rl:data`` (``previous`` = the cursor the fetch
started from). ``Planner.replan(request, advanced)`` recomputes the same plan from a recorded
``DataCursorAdvanced``, which is how a plan whose write was interrupted is completed.

Planning is deterministic: same request, same configuration, same cursor -> same events.
A request the configuration cannot serve (unknown dataset, invalid sampling override, a
batching strategy that loses or repeats samples) raises ``ConfigError`` naming the rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from pydantic import ValidationError

from engine.batching import (
    BatchingStrategy,
    fifo_batching,
    resolve_profile,
    resolve_sampling_params,
    resolve_stopping,
)
from engine.config.rollout import RolloutConfig
from engine.data_source import (
    DataCursor,
    JsonlDataset,
    MultiDataSource,
    build_eval_tasks,
    expand_groups,
)
from engine.domain import (
    Batch,
    DatasetConfig,
    EvaluatorProfile,
    SamplingParams,
    StoppingCriteria,
    Task,
)
from engine.errors import ConfigError
from engine.events.base import Event
from engine.events.catalog import (
    BatchSealed,
    DataCursorAdvanced,
    RolloutKind,
    RolloutPlanned,
    RolloutRequested,
    TailCarried,
    TaskFetched,
    TaskJoined,
)
from engine.messages import explain
from engine.projections.data_cursor import DataState
from engine.projections.rollout import RolloutState, staleness_floor

__all__ = ["Plan", "Planner", "admission_refused", "admission_wait", "check_partial"]

_L = TypeVar("_L", StoppingCriteria, SamplingParams)

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
        return TaskJoined(rollout_id=rid, sample_id=sample_id, index=index,
                          group_index=group_index, same_as=same_as, producer="",
                          causation=None)
    ev = _new(TaskJoined)
    _set(ev, "__dict__", {
        "type": "TaskJoined", "producer": "", "causation": None, "rollout_id": rid,
        "sample_id": sample_id, "index": index, "group_index": group_index, "same_as": same_as,
    })
    _set(ev, "__pydantic_fields_set__", set(_JOINED_SET))
    _set(ev, "__pydantic_extra__", None)
    _set(ev, "__pydantic_private__", None)
    return ev


class Planner:
    """Turns requests into plans for one rollout configuration and set of evaluator profiles.

    Holds the datasets (read once, on first use) and nothing that depends on the log: the
    cursor comes in with every call, so the same planner serves live planning and replays.
    """

    def __init__(
        self,
        config: RolloutConfig,
        specs: Mapping[str, EvaluatorProfile],
        *,
        batching: BatchingStrategy = fifo_batching,
    ) -> None:
        if not specs:
            raise ConfigError("the scheduler needs at least one evaluator profile")
        self._config = config
        self._specs = dict(specs)
        self._batching = batching
        self._files: dict[str, JsonlDataset] = {}
        for train in config.datasets:
            self._files[train.name] = JsonlDataset(train)
        for evaluation in config.eval_datasets:
            self._files[evaluation.name] = JsonlDataset(evaluation)
        self._sources: dict[tuple[str, ...], MultiDataSource] = {}
        self._eval_copies: dict[tuple[str, int], JsonlDataset] = {}

    @property
    def specs(self) -> Mapping[str, EvaluatorProfile]:
        """The evaluator profiles, by evaluator id."""
        return self._specs

    def validate(self) -> None:
        """Refuse, at start-up, what would otherwise fail (or silently misroute) when a
        rollout is requested: a dataset whose ``task_type`` no evaluator profile serves, and
        any dataset line that does not parse. Raises ``ConfigError`` naming the dataset
        (and the evaluator ids that exist, or the file and line)."""
        for cfg in (*self._config.datasets, *self._config.eval_datasets):
            if cfg.task_type not in self._specs:
                raise ConfigError(
                    f"dataset {cfg.name!r} ({cfg.path}): task_type {cfg.task_type!r} is served "
                    f"by no evaluator profile (evaluator ids: {sorted(self._specs)})"
                )
        for dataset in self._files.values():
            dataset.validate()

    def plan(self, request: RolloutRequested, data: DataState) -> Plan:
        """The plan of ``request`` given the data cursors folded from ``rl:data``."""
        check_partial(request)
        if request.kind is RolloutKind.EVAL:
            return self._plan_eval(request)
        names = self._train_names(request)
        source = self._source(names)
        cursor = data.cursor_for(names) or source.start(request.seed)
        tails = data.carried_for(request.request_stream) if request.request_stream else []
        return self._plan_train(request, source, cursor, tails)

    def replan(
        self,
        request: RolloutRequested,
        advanced: DataCursorAdvanced,
        data: DataState | None = None,
    ) -> Plan:
        """The plan that was written with ``advanced`` (same events, same ids); ``data``
        holds the carried tails it took over (``advanced.carried``), if any."""
        if request.kind is RolloutKind.EVAL:
            return self._plan_eval(request)
        tails: list[TailCarried] = []
        for rid in advanced.carried:
            tail = data.tails.get(rid) if data is not None else None
            if tail is None:
                raise ConfigError(
                    f"rollout {request.rollout_id!r}: its plan took over the tail of rollout "
                    f"{rid!r}, which rl:data does not hold"
                )
            tails.append(tail)
        names = self._train_names(request)
        try:
            cursor = DataCursor.model_validate(advanced.previous)
        except ValidationError as exc:
            raise ConfigError(
                f"rollout {request.rollout_id!r}: its recorded DataCursorAdvanced has an "
                f"invalid previous cursor: {exc.errors()[0]['msg']}"
            ) from None
        return self._plan_train(request, self._source(names), cursor, tails)

    # ------------------------------------------------------------ fetch

    def _select(
        self,
        request: RolloutRequested,
        configured: Sequence[DatasetConfig],
        what: str,
    ) -> list[DatasetConfig]:
        where = f"rollout {request.rollout_id!r} ({request.kind.value})"
        if not configured:
            raise ConfigError(f"{where}: the rollout config defines no {what} datasets")
        if request.datasets is None:
            return list(configured)
        known = {d.name: d for d in configured}
        unknown = [name for name in request.datasets if name not in known]
        if unknown:
            raise ConfigError(
                f"{where}: requested datasets {unknown} are not {what} datasets of the rollout "
                f"config (known: {sorted(known)})"
            )
        if not request.datasets:
            raise ConfigError(f"{where}: 'datasets' is an empty list")
        wanted = set(request.datasets)
        return [d for d in configured if d.name in wanted]

    def _train_names(self, request: RolloutRequested) -> tuple[str, ...]:
        chosen = self._select(request, self._config.datasets, "training")
        return tuple(d.name for d in chosen)

    def _source(self, names: tuple[str, ...]) -> MultiDataSource:
        source = self._sources.get(names)
        if source is None:
            source = MultiDataSource([self._files[name] for name in names])
            self._sources[names] = source
        return source

    def _plan_train(
        self,
        request: RolloutRequested,
        source: MultiDataSource,
        cursor: DataCursor,
        tails: Sequence[TailCarried] = (),
    ) -> Plan:
        n_carried = sum(len({t.group_index for t in tail.tasks}) for tail in tails)
        try:
            records, after = source.fetch(cursor, max(0, request.n_planned_prompts - n_carried))
        except ConfigError as exc:
            raise ConfigError(f"rollout {request.rollout_id!r}: {exc}") from None
        copies = request.n_samples_per_prompt
        if copies is not None:
            overridden: dict[str, DatasetConfig] = {}
            for i, record in enumerate(records):
                cfg = overridden.get(record.dataset.name)
                if cfg is None:
                    cfg = record.dataset.model_copy(update={"n_samples_per_prompt": copies})
                    overridden[record.dataset.name] = cfg
                records[i] = replace(record, dataset=cfg)
        tasks = expand_groups(records, rollout_id=request.rollout_id)
        advanced = DataCursorAdvanced(
            rollout_id=request.rollout_id,
            kind=RolloutKind.TRAIN,
            cursor=after.model_dump(mode="json"),
            previous=cursor.model_dump(mode="json"),
            carried=[tail.rollout_id for tail in tails],
        )
        return self._assemble(request, tasks, advanced, _carried(request, tasks, tails))

    def _plan_eval(self, request: RolloutRequested) -> Plan:
        chosen = self._select(request, self._config.eval_datasets, "eval")
        copies = request.n_samples_per_prompt
        datasets: list[JsonlDataset] = []
        for cfg in chosen:
            if copies is None or cfg.copies_per_prompt == copies:
                datasets.append(self._files[cfg.name])
                continue
            key = (cfg.name, copies)
            dataset = self._eval_copies.get(key)
            if dataset is None:
                dataset = JsonlDataset(cfg.model_copy(update={"n_samples_per_eval_prompt": copies}))
                self._eval_copies[key] = dataset
            datasets.append(dataset)
        tasks = build_eval_tasks(datasets, rollout_id=request.rollout_id)
        advanced = DataCursorAdvanced(
            rollout_id=request.rollout_id, kind=RolloutKind.EVAL, cursor={}
        )
        return self._assemble(request, tasks, advanced)

    # ------------------------------------------------------------ batch + cascade

    def _assemble(
        self,
        request: RolloutRequested,
        tasks: list[Task],
        advanced: DataCursorAdvanced,
        carried: Sequence[TaskFetched] = (),
    ) -> Plan:
        rid = request.rollout_id
        if not tasks and not carried:
            raise ConfigError(f"rollout {rid!r}: the selected datasets yield no samples")
        flags_stop = _layer(StoppingCriteria, request.stopping, rid, "stopping")
        flags_sampling = _layer(SamplingParams, request.sampling_params, rid, "sampling_params")
        spec_of: dict[str, EvaluatorProfile] = {}
        for task in tasks:
            if task.task_type not in spec_of:
                spec_of[task.task_type] = resolve_profile(task.task_type, self._specs)
        # Per dataset (which fixes the task type and so the profile): the resolved settings,
        # computed once and shared by every TaskFetched of that dataset. Resolving them all
        # here also validates every setting before anything is written.
        resolved: dict[str, tuple[StoppingCriteria, SamplingParams]] = {}
        for task in tasks:
            name = task.dataset_name
            if name not in resolved:
                dataset = self._files[name].config
                profile = spec_of[task.task_type]
                resolved[name] = (
                    resolve_stopping(flags_stop, profile, dataset),
                    resolve_sampling_params(flags_sampling, profile, dataset),
                )

        def make_tasks(start: int, stop: int) -> list[TaskFetched]:
            out: list[TaskFetched] = []
            for task in tasks[start:stop]:
                stopping, sampling = resolved[task.dataset_name]
                out.append(
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
                        stopping=stopping,
                        sampling_params=sampling,
                    )
                )
            n = len(tasks)
            out.extend(carried[max(start - n, 0) : max(stop - n, 0)])
            return out

        def make_joined(at: int) -> TaskJoined | None:
            # Read from the tasks: a TaskFetched holds a task's group fields as they are
            # (JSON values as given, the metadata copied, the resolved settings shared per
            # dataset), so fields equal here are equal there, and TaskJoined.of would join.
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

        sealed: list[BatchSealed] = []
        for seq, batch in enumerate(self._batch(rid, tasks) if tasks else []):
            sealed.append(
                BatchSealed(
                    rollout_id=rid,
                    batch_id=batch.batch_id,
                    seq=seq,
                    evaluator_id=spec_of[batch.task_type].evaluator_id,
                    sample_ids=[task.sample_id for task in batch.tasks],
                )
            )
        planned = RolloutPlanned(
            rollout_id=rid,
            n_samples=len(tasks) + len(carried),
            n_batches=len(sealed),
            batch_ids=[b.batch_id for b in sealed],
        )
        group_first: dict[int, int] = {}
        for at, group in enumerate(
            [*(task.group_index for task in tasks), *(ev.group_index for ev in carried)]
        ):
            group_first.setdefault(group, at)
        return Plan(
            request=request,
            cursor=advanced,
            sample_ids=(
                *(task.sample_id for task in tasks),
                *(ev.sample_id for ev in carried),
            ),
            batches=tuple(sealed),
            planned=planned,
            make_tasks=make_tasks,
            group_first=group_first,
            make_joined=make_joined,
        )

    def _batch(self, rollout_id: str, tasks: list[Task]) -> list[Batch]:
        name = getattr(self._batching, "__name__", repr(self._batching))
        where = f"rollout {rollout_id!r}: batching strategy {name}"
        batches = self._batching(tasks, self._specs)
        seen: set[str] = set()
        batch_ids: set[str] = set()
        for batch in batches:
            if batch.batch_id in batch_ids:
                raise ConfigError(f"{where} returned batch id {batch.batch_id!r} twice")
            batch_ids.add(batch.batch_id)
            for task in batch.tasks:
                if task.sample_id in seen:
                    raise ConfigError(f"{where} placed sample {task.sample_id!r} in two batches")
                seen.add(task.sample_id)
        if len(seen) != len(tasks):
            missing = [t.sample_id for t in tasks if t.sample_id not in seen][:5]
            raise ConfigError(
                f"{where} placed {len(seen)} of {len(tasks)} samples (missing e.g. {missing})"
            )
        return batches


def _carried(
    request: RolloutRequested, tasks: Sequence[Task], tails: Sequence[TailCarried]
) -> list[TaskFetched]:
    """The ``TaskFetched`` of the carried samples as they open in this rollout: after its
    own samples (indices and groups numbered on from them), tail by tail in log order, each
    marked with the rollout it runs in (``carried_from``) and keeping that rollout's sample
    id, prompt and resolved settings."""
    index = len(tasks)
    group = len({t.group_index for t in tasks})
    out: list[TaskFetched] = []
    for tail in tails:
        groups: dict[int, int] = {}
        for ev in sorted(tail.tasks, key=lambda t: t.index):
            if ev.group_index not in groups:
                groups[ev.group_index] = group
                group += 1
            out.append(
                ev.model_copy(
                    update={
                        "rollout_id": request.rollout_id,
                        "index": index,
                        "group_index": groups[ev.group_index],
                        "carried_from": ev.carried_from or tail.rollout_id,
                        "producer": "",
                        "causation": None,
                    }
                )
            )
            index += 1
    return out


def check_partial(request: RolloutRequested) -> None:
    """Refuse partial-rollout options the planner cannot honour, naming the rollout:
    over-provisioning and a carried tail are for training requests (an eval runs every
    prompt of its datasets)."""
    where = f"rollout {request.rollout_id!r} ({request.kind.value})"
    if request.kind is RolloutKind.EVAL and request.overprovision != 1.0:
        raise ConfigError(f"{where}: overprovision applies to training requests only")
    if request.kind is RolloutKind.EVAL and (request.tail == "carry" or request.request_stream):
        raise ConfigError(f"{where}: tail='carry' and request_stream are for training requests")


def admission_refused(state: RolloutState) -> str | None:
    """Why the scheduler must not admit more batches of a rollout (None: it may).

    A rollout that failed, or that became ready with an aborted tail (an over-provisioned
    rollout done with its first ``n_prompts`` whole groups), can use no more work: the
    batches it has not admitted yet would only be aborted. Pure: read off the folded
    rollout stream."""
    if state.failed is not None:
        return "the rollout failed"
    ready = state.ready
    if ready is not None and ready.tail_sample_ids and not ready.tail_carried:
        return "the rollout is ready and its tail was aborted"
    return None


def admission_wait(state: RolloutState, published: int | None) -> str | None:
    """Why a rollout's batches must wait for a newer policy version (None: they need not).

    A rollout's staleness bound is out of reach by construction while its floor (the
    trainer's current version minus ``max_staleness``) is above the highest published
    version: no model server can hold newer weights than were published, so every token
    it generated now would be excluded. That happens when the request's ``policy_version``
    is more than ``max_staleness`` ahead of what was published. Before any publication the
    servers' weights are the trainer's starting point and nothing waits. Pure."""
    request = state.request
    if request is None or request.max_staleness is None or published is None:
        return None
    floor = staleness_floor(request, published)
    if floor is None or floor <= published:
        return None
    return (
        f"its staleness bound needs weights of version {floor} or newer; the highest "
        f"published is {published}"
    )


def _layer(model: type[_L], values: Mapping[str, Any], rollout_id: str, what: str) -> _L:
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        problems = "; ".join(f"{key or what}: {problem}" for key, problem in explain(exc))
        raise ConfigError(f"rollout {rollout_id!r}: request {what}: {problems}") from None

