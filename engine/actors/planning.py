"""Planning a rollout: the scheduler's pure core, from a ``RolloutRequested`` to its plan.

``Planner.plan(request, data)`` decides everything the scheduler writes before admission:

* **fetch**: a training request takes ``n_prompts`` prompts (``ceil(n_prompts *
  overprovision)`` when over-provisioned) from a ``MultiDataSource`` over the training
  datasets (or those named in ``request.datasets``), from the cursor folded from ``rl:data``
  for that dataset set, or ``source.start(request.seed)`` for the first rollout over it. An
  eval request runs every prompt of the eval datasets (``max_prompts`` per dataset),
  interleaved round-robin, and never moves a training cursor. ``request.n_samples_per_prompt``
  overrides the datasets' group size.
* **distribute / batch**: samples get ids ``engine.domain.sample_id_for(rollout_id, index)``
  and are batched by the ``BatchingStrategy`` (default ``fifo_batching``); each batch's
  evaluator is ``resolve_profile(task_type)``.
* **cascade**: stopping criteria and sampling params resolve field by field from the
  request's (coarsest) through the evaluator profile's defaults to the dataset's own values
  (finest, wins). This is the only place the cascade is applied: each ``TaskFetched`` carries
  its sample's resolved values, computed once per dataset. Knobs stay in the request copy.

The plan's events, in stream order: the copy of the request, one ``TaskFetched`` per sample
(index order), one ``BatchSealed`` per batch (``seq`` order) and ``RolloutPlanned``;
``cursor`` is the ``DataCursorAdvanced`` for ``rl:data``. ``Planner.replan(request,
advanced)`` recomputes the same plan from a recorded cursor, which is how a plan whose write
was interrupted is completed. Planning is deterministic; a request the configuration cannot
serve raises ``ConfigError`` naming the rollout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from pydantic import ValidationError

from engine.actors.plan import Plan, join_maker, task_maker
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
from engine.events.catalog import (
    BatchSealed,
    DataCursorAdvanced,
    RolloutKind,
    RolloutPlanned,
    RolloutRequested,
    TailCarried,
    TaskFetched,
)
from engine.messages import explain
from engine.projections.control import ControlState
from engine.projections.data_cursor import DataState
from engine.projections.rollout import RolloutState, staleness_floor

__all__ = [
    "Plan",
    "Planner",
    "admission_refused",
    "admission_wait",
    "check_partial",
    "pace_wait",
]

_L = TypeVar("_L", StoppingCriteria, SamplingParams)


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
        spec_of, resolved = self._resolve(request, tasks)
        sealed = [
            BatchSealed(
                rollout_id=rid,
                batch_id=batch.batch_id,
                seq=seq,
                evaluator_id=spec_of[batch.task_type].evaluator_id,
                sample_ids=[task.sample_id for task in batch.tasks],
            )
            for seq, batch in enumerate(self._batch(rid, tasks) if tasks else [])
        ]
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
            make_tasks=task_maker(rid, tasks, resolved, carried),
            group_first=group_first,
            make_joined=join_maker(rid, tasks, group_first),
        )

    def _resolve(
        self, request: RolloutRequested, tasks: list[Task]
    ) -> tuple[dict[str, EvaluatorProfile], dict[str, tuple[StoppingCriteria, SamplingParams]]]:
        """Each task type's profile, and each dataset's resolved settings (which the dataset's
        task type fixes), computed once; resolving them all validates every setting before
        anything is written."""
        rid = request.rollout_id
        flags_stop = _layer(StoppingCriteria, request.stopping, rid, "stopping")
        flags_sampling = _layer(SamplingParams, request.sampling_params, rid, "sampling_params")
        spec_of: dict[str, EvaluatorProfile] = {}
        resolved: dict[str, tuple[StoppingCriteria, SamplingParams]] = {}
        for task in tasks:
            if task.task_type not in spec_of:
                spec_of[task.task_type] = resolve_profile(task.task_type, self._specs)
            if task.dataset_name not in resolved:
                dataset = self._files[task.dataset_name].config
                profile = spec_of[task.task_type]
                resolved[task.dataset_name] = (
                    resolve_stopping(flags_stop, profile, dataset),
                    resolve_sampling_params(flags_sampling, profile, dataset),
                )
        return spec_of, resolved

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


def pace_wait(request: RolloutRequested | None, control: ControlState) -> str | None:
    """Why a ``pace`` rollout's next batch must wait (None: it need not).

    The rule: a batch is admitted only once (a) the highest published version is active, so
    its samples start on the trainer's current version ``P``, and (b) at most
    ``max_staleness`` bounded training rollouts requested before this one are not yet
    trained on (``ControlState.rollouts_ahead``). A trainer publishes one version per step
    and steps on rollouts in request order, so before this rollout is decided it publishes
    at most that many versions: the trainer's version at the decision is at most ``P +
    ahead``, and every sample admitted meets the bound. Nothing is generated that the bound
    would exclude. A trainer that publishes more often breaks the premise; the worker's
    guard and the decision still drop what went stale. Pure."""
    if request is None or request.staleness_policy != "pace" or request.max_staleness is None:
        return None
    if request.kind is not RolloutKind.TRAIN:
        return None
    published = control.published
    if published is not None and control.needs_sync(published):
        return f"staleness_policy 'pace': version {published} is published, not active yet"
    ahead = control.rollouts_ahead(request.rollout_id)
    if ahead <= request.max_staleness:
        return None
    return (
        f"staleness_policy 'pace': {ahead} earlier bounded rollouts are not yet trained on, "
        f"so a sample admitted now could be {ahead} versions behind when decided "
        f"(max_staleness {request.max_staleness})"
    )


def _layer(model: type[_L], values: Mapping[str, Any], rollout_id: str, what: str) -> _L:
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        problems = "; ".join(f"{key or what}: {problem}" for key, problem in explain(exc))
        raise ConfigError(f"rollout {rollout_id!r}: request {what}: {problems}") from None
