"""The finalizer's decisions: pure functions of the rollout fold's records.

When a rollout is worth deciding (:func:`worth_deciding`, from the fold's counters), which
samples it is made of (:func:`select_groups`: every sample, or an over-provisioned
rollout's first whole groups), which are stale (:func:`stale_split`) and which of those the
``keep`` policy keeps (:func:`kept_stale_ids`), kept or dropped by the
request's filters (:func:`apply_filters`) and by the CE lane (an over-long sub-sample drops
its trajectory), whether the teacher must score them first (:func:`decide_capture`), and
the ``RolloutReady`` with its counts and metrics (:func:`decide_ready`); then what settles a
tail: its aborts (:func:`tail_aborts`) or the ``TailCarried`` that hands it to the next
request of its stream (:func:`tail_carried`, from the tasks read back). They read only
:class:`~engine.projections.rollout.SampleRecord` fields, so the finalizer decides from a
few hundred bytes a sample, and they are tested from events, without Redis.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from engine.events.catalog import (
    CaptureRequested,
    FilterSpec,
    RolloutKind,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    TailCarried,
    TaskFetched,
)
from engine.outcomes import AbortClass, FailureClass
from engine.projections.lanes import Lane, needs_teacher, plan_ce, request_lane
from engine.projections.rollout import RolloutState, SampleRecord, staleness_floor
from engine.projections.summary import rows_metrics

__all__ = [
    "Routed",
    "Selection",
    "apply_filters",
    "carried_sources",
    "carries_tail",
    "decide_capture",
    "decide_ready",
    "groups_needed",
    "kept_stale_ids",
    "ready_metrics",
    "route",
    "select_groups",
    "stale_split",
    "tail_aborts",
    "tail_carried",
    "version_spread",
    "worth_deciding",
]


def groups_needed(state: RolloutState) -> int | None:
    """Whole groups an over-provisioned training rollout becomes ready with (its request's
    ``n_prompts``); None: the rollout waits for every planned sample."""
    request = state.request
    if request is None or request.kind is not RolloutKind.TRAIN:
        return None
    if request.n_planned_prompts <= request.n_prompts:
        return None
    return request.n_prompts


def worth_deciding(state: RolloutState) -> bool:
    """A cheap test, from the fold's counters, that a decision may be due."""
    planned = state.planned
    if planned is None:
        return False
    need = groups_needed(state)
    if need is not None and len(state.samples) >= planned.n_samples:
        if len(state.completed_groups) < need:
            return False
    elif state.n_terminal < planned.n_samples:
        return False
    return state.capture is None or state.n_scored >= len(state.capture.sample_ids)


@dataclass(frozen=True, slots=True)
class Selection:
    """The groups a ready rollout is made of (index order) and the tail's ids."""

    samples: list[SampleRecord]
    tail: list[str]


def select_groups(state: RolloutState) -> Selection | None:
    """Every sample once all are terminal; for an over-provisioned rollout the first
    ``n_prompts`` groups to become whole, in log order (None: not yet)."""
    planned = state.planned
    if planned is None or len(state.samples) < planned.n_samples:
        return None
    need = groups_needed(state)
    if need is None or need >= len(state.group_size):
        if not state.all_terminal():
            return None
        return Selection(state.ordered(), [])
    if len(state.completed_groups) < need:
        return None
    chosen = set(state.completed_groups[:need])
    ordered = state.ordered()
    return Selection(
        [r for r in ordered if r.group_index in chosen],
        [r.sample_id for r in ordered if r.group_index not in chosen],
    )


def stale_split(
    samples: list[SampleRecord], floor: int | None
) -> tuple[list[SampleRecord], list[SampleRecord], int]:
    """``(fresh, stale, stale_tokens)`` under the staleness bound ``floor`` (a completed
    sample with a sampled token older than ``floor`` or of unknown version is stale; so is
    one the worker ended as ``stale``)."""
    if floor is None:
        return samples, [], 0
    fresh: list[SampleRecord] = []
    stale: list[SampleRecord] = []
    tokens = 0
    for r in samples:
        if r.aborted:
            (stale if r.abort_class is AbortClass.STALE else fresh).append(r)
            continue
        if not r.completed or not r.n_sampled:
            fresh.append(r)
            continue
        low = r.low_version
        if low < 0 or low < floor:
            stale.append(r)
            tokens += r.n_sampled
        else:
            fresh.append(r)
    return fresh, stale, tokens


def kept_stale_ids(request: RolloutRequested | None, stale: list[SampleRecord]) -> set[str]:
    """The stale samples a ready rollout keeps: under the ``keep`` policy the completed ones
    (their rewards count in their groups' statistics; the trainer gives them no gradient,
    ``engine.collate``), except in the CE lane, whose sub-samples have no group statistics
    to keep them for; none under ``drop`` and ``pace``."""
    if request is None or request.staleness_policy != "keep":
        return set()
    if request_lane(request) is Lane.CE:
        return set()
    return {r.sample_id for r in stale if r.completed}


_INFRA = frozenset({AbortClass.INFRA_CONN, AbortClass.INFRA_SANDBOX, AbortClass.INFRA_OTHER})


def apply_filters(
    state: RolloutState, samples: list[SampleRecord] | None = None
) -> tuple[list[str], list[str]]:
    """``(kept, dropped)`` ids in index order: reward-based rejection, then finish-only.
    A group's rewards are those of its samples that have one: a sample aborted by the
    infrastructure (its retries spent) is no zero reward of the policy's, so it takes no part
    in its group's statistics, as a removed sample takes none in the trainer's advantages
    (``engine.losses.group_advantages``)."""
    filters = state.request.filters if state.request is not None else FilterSpec()
    ordered = state.ordered() if samples is None else samples
    kept = ordered
    if filters.reject_equal_rewards:
        rewards: dict[int, set[float]] = defaultdict(set)
        for r in ordered:
            if r.abort_class not in _INFRA:
                rewards[r.group_index].add(r.reward)
        kept = [r for r in kept if len(rewards[r.group_index]) > 1]
    if filters.finish_only:
        kept = [r for r in kept if r.completed and r.finished]
    kept_ids = {r.sample_id for r in kept}
    dropped = [r.sample_id for r in ordered if r.sample_id not in kept_ids]
    return [r.sample_id for r in kept], dropped


def _unscored(state: RolloutState, kept: list[str]) -> list[str]:
    return [
        sid for sid in kept if (r := state.samples[sid]).completed and not r.scored
    ]


def decide_capture(
    state: RolloutState, *, top_k: int = 20, trainer_version: int | None = None
) -> CaptureRequested | None:
    """The teacher capture to ask for, once the rollout's groups are terminal."""
    if state.decided or not needs_teacher(state.request):
        return None
    selection = select_groups(state)
    if selection is None:
        return None
    fresh, _, _ = stale_split(selection.samples, staleness_floor(state.request, trainer_version))
    kept, _ = apply_filters(state, fresh)
    missing = _unscored(state, kept)
    if not missing:
        return None
    assert state.rollout_id is not None
    return CaptureRequested(rollout_id=state.rollout_id, sample_ids=missing, top_k=top_k)


@dataclass(frozen=True, slots=True)
class Routed:
    """What the lane makes of the filtered samples, for ``RolloutReady``."""

    kept: list[str]
    dropped: list[str]
    gbs_scale: float = 1.0
    metrics: dict[str, float] | None = None


def route(state: RolloutState, kept: list[str], dropped: list[str]) -> Routed:
    """Route the filtered samples by the request's lane: the CE lane drops trajectories
    with an over-long sub-sample whole (kept order is kept; dropped ids stay in index order)
    and reports its ``gbs_scale``; the other lanes change nothing here (their shaping
    happens when the samples are built)."""
    request = state.request
    if request_lane(request) is not Lane.CE:
        return Routed(kept=kept, dropped=dropped)
    plan = plan_ce(
        request,
        (
            (sid, r.ce or ())
            for sid in kept
            if (r := state.samples.get(sid)) is not None and r.completed
        ),
    )
    gone = set(plan.too_long)
    samples = state.samples

    def index(sid: str) -> int:
        r = samples.get(sid)
        return r.index if r is not None else 0

    return Routed(
        kept=[sid for sid in kept if sid not in gone],
        dropped=sorted([*dropped, *plan.too_long], key=index),
        gbs_scale=plan.gbs_scale,
        metrics={
            "ce/n_subsamples": float(len(plan.chunks)),
            "ce/n_trajectories": float(plan.n_trajectories),
            "ce/n_dropped_too_long": float(len(plan.too_long)),
            "ce/gbs_scale": plan.gbs_scale,
        },
    )


def ready_metrics(
    state: RolloutState,
    kept: list[str],
    dropped: list[str],
    samples: list[SampleRecord] | None = None,
) -> dict[str, float]:
    """Counts, reward statistics, failure-class counts and per-dataset eval metrics."""
    chosen = state.ordered() if samples is None else samples
    n = len(chosen)
    completed = [r for r in chosen if r.completed]
    out: dict[str, float] = {
        "n_samples": float(n),
        "n_kept": float(len(kept)),
        "n_dropped": float(len(dropped)),
        "n_completed": float(len(completed)),
        "n_aborted": float(n - len(completed)),
        "reward_mean": sum(r.reward for r in chosen) / n if n else 0.0,
        "abort_rate": (n - len(completed)) / n if n else 0.0,
        "response_length_mean": (
            sum(r.response_length for r in completed) / len(completed) if completed else 0.0
        ),
    }
    counts = Counter(r.failure_class for r in chosen)
    for cls in FailureClass:
        count = counts.get(cls, 0)
        if count or not cls.engine_ended:
            out[f"class/{cls.value}"] = float(count)
    kind = state.request.kind if state.request is not None else RolloutKind.TRAIN
    prefix = "eval" if kind is RolloutKind.EVAL else "rollout"
    out.update(rows_metrics(chosen, prefix=prefix))
    return out


def version_spread(state: RolloutState, kept: list[str]) -> dict[str, int]:
    """Sampled tokens of the kept completed samples per weight version (as strings)."""
    counts: Counter[int] = Counter()
    for sid in kept:
        r = state.samples.get(sid)
        if r is None or not r.completed:
            continue
        counts.update(dict(r.versions))
    return {str(v): counts[v] for v in sorted(counts)}


def decide_ready(state: RolloutState, trainer_version: int | None = None) -> RolloutReady | None:
    """The rollout's ``RolloutReady``, or None while it is not ready (or already decided)."""
    if state.decided:
        return None
    selection = select_groups(state)
    if selection is None:
        return None
    request = state.request
    floor = staleness_floor(request, trainer_version)
    fresh, stale, stale_tokens = stale_split(selection.samples, floor)
    kept_stale = kept_stale_ids(request, stale)
    candidates = fresh
    if kept_stale:
        keep = kept_stale | {r.sample_id for r in fresh}
        candidates = [r for r in selection.samples if r.sample_id in keep]
    kept, dropped = apply_filters(state, candidates)
    if needs_teacher(request) and _unscored(state, [s for s in kept if s not in kept_stale]):
        return None
    routed = route(state, kept, dropped)
    kept, dropped = routed.kept, routed.dropped
    chosen = selection.samples
    n_completed = sum(1 for r in chosen if r.completed)
    metrics = {**ready_metrics(state, kept, dropped, chosen), **(routed.metrics or {})}
    current = None
    if floor is not None:
        assert request is not None and request.max_staleness is not None
        current = floor + request.max_staleness
        metrics["n_stale"] = float(len(stale))
        if request.staleness_policy == "keep":
            metrics["n_stale_kept"] = float(len(kept_stale.intersection(kept)))
        metrics["stale_tokens"] = float(stale_tokens)
    if selection.tail:
        metrics["n_tail"] = float(len(selection.tail))
    assert state.rollout_id is not None
    return RolloutReady(
        rollout_id=state.rollout_id,
        iteration=request.iteration if request is not None else 0,
        kind=request.kind if request is not None else RolloutKind.TRAIN,
        policy_version=request.policy_version if request is not None else 0,
        sample_ids=kept,
        dropped_sample_ids=dropped,
        dummy=not kept,
        n_completed=n_completed,
        n_aborted=len(chosen) - n_completed,
        metrics=metrics,
        version_tokens=version_spread(state, kept),
        gbs_scale=routed.gbs_scale,
        trainer_version=current,
        stale_sample_ids=[r.sample_id for r in stale],
        stale_tokens=stale_tokens,
        tail_sample_ids=selection.tail,
        tail_carried=bool(selection.tail) and request is not None and request.tail == "carry",
    )


def carried_sources(state: RolloutState) -> dict[str, set[str]]:
    """Per rollout a carried sample runs in, this rollout's carried sample ids (kept as the
    tasks are folded: no scan)."""
    return {src: set(ids) for src, ids in state.carried.items()}


def carries_tail(state: RolloutState, ready: RolloutReady) -> bool:
    """Whether ``ready`` hands its tail to the next request of its stream (a ``TailCarried``
    on ``rl:data``, built by :func:`tail_carried` from the tail's tasks)."""
    request = state.request
    return ready.tail_carried and request is not None and request.request_stream is not None


def tail_carried(
    state: RolloutState, ready: RolloutReady, tasks: Mapping[str, TaskFetched]
) -> TailCarried | None:
    """The ``TailCarried`` (for ``rl:data``) of a rollout ready with a carried tail, from
    the tail samples' tasks (read back by id)."""
    request = state.request
    if not carries_tail(state, ready) or request is None or request.request_stream is None:
        return None
    return TailCarried(
        rollout_id=ready.rollout_id,
        request_stream=request.request_stream,
        tasks=[tasks[sid] for sid in ready.tail_sample_ids],
    )


def tail_aborts(state: RolloutState, ready: RolloutReady) -> list[SampleAborted]:
    """The ``SampleAborted`` (``tail_aborted``) of every tail sample still without a
    terminal event, for a request whose tail is aborted (index order)."""
    if not ready.tail_sample_ids or ready.tail_carried:
        return []
    out: list[SampleAborted] = []
    for sid in ready.tail_sample_ids:
        r = state.samples[sid]
        if r.done:
            continue
        out.append(
            SampleAborted(
                rollout_id=ready.rollout_id,
                sample_id=sid,
                attempt=max(r.attempt, 0),
                abort_class=AbortClass.TAIL_ABORTED,
                error=(
                    "tail of an over-provisioned rollout: it became ready with "
                    f"{len(ready.sample_ids) + len(ready.dropped_sample_ids)} samples of its "
                    "first whole groups"
                ),
                turns=r.turns,
            )
        )
    return out
