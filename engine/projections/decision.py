"""The finalizer's compact fold: what deciding a rollout needs, a few hundred bytes a sample.

:class:`~engine.projections.rollout.RolloutProjection` keeps every sample whole -- its task,
its turns and its trajectory with the token arrays, about 9 KB a sample on the bench's
workload -- which is what the trainer's samples and the artifacts are built from. The
finalizer only *decides*: which samples are kept, dropped, stale or tail, and the counts and
metrics of the ``RolloutReady``. This module folds the same stream into what that needs and
nothing more, so a finalizer following a 1M-sample rollout holds a :class:`Brief` per sample
(ids, group, dataset, attempt, turn count, outcome, reward, response length, sampled tokens
per weight version, whether the teacher scored it) instead of the events themselves:

* ``Brief`` per sample, updated in place by the same idempotence rules as the full fold
  (a duplicate task ignored, ``SampleStarted`` never lowers the attempt, the first terminal
  wins, ``TeacherScored`` counts for the terminal attempt only);
* the CE lane's sub-sample cut points (``CeChunk``) of a completed sample, only for a request
  routed to that lane; the whole ``TaskFetched`` of a sample, only for a request whose tail
  may be carried (the ``TailCarried`` repeats the tasks);
* the carried samples' source rollouts, kept as the tasks arrive (the relay's input), and the
  counters the full fold keeps (terminal, scored, whole groups in log order).

The decisions over this state (:func:`decide_ready`, :func:`decide_capture`, ...) are the
finalizer's; they give the ``RolloutReady`` the full-state functions of
:mod:`engine.actors.finalizer` give from :class:`~engine.projections.rollout.RolloutState`,
equal field for field (``tests/rollout/test_finalizer_compact.py`` holds them to it on
varied rollouts). Like the full fold, ``evolve`` updates its state in place: the fold owns it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from engine.errors import RolloutError
from engine.events.arrays import Mask, TokenIds, compact_size, from_compact
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    CaptureRequested,
    FilterSpec,
    PromptStored,
    RolloutFailed,
    RolloutKind,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TailCarried,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.outcomes import AbortClass, FailureClass, TerminationReason
from engine.projections.lanes import (
    CeChunk,
    Lane,
    Routed,
    ce_chunks,
    needs_teacher,
    plan_ce,
    request_lane,
)
from engine.projections.rollout import staleness_floor
from engine.projections.summary import rows_metrics, summary_of

__all__ = [
    "COMPLETED",
    "PENDING",
    "ABORTED",
    "Brief",
    "DecisionProjection",
    "DecisionState",
    "Selection",
    "apply_filters",
    "build_summary",
    "carried_sources",
    "decide_capture",
    "decide_ready",
    "groups_needed",
    "ready_metrics",
    "route",
    "select_groups",
    "stale_split",
    "tail_aborts",
    "tail_carried",
    "version_spread",
    "worth_deciding",
]

PENDING, COMPLETED, ABORTED = 0, 1, 2
UNKNOWN_VERSION = -1  # engine.agents.result.UNKNOWN_VERSION (projections import no agents)
_FINISH = TerminationReason.FINISH.value


@dataclass(slots=True)
class Brief:
    """One sample as the finalizer needs it (see the module docstring).

    ``turns`` is the turn count of the current attempt while the sample runs, and from its
    terminal event on the count its row reports (``SampleCompleted.n_turns`` or the turns
    recorded; ``SampleAborted.turns``). The sampled tokens' weight versions are kept as a
    count and the oldest version, with the per-version counts only when they differ
    (:attr:`versions`)."""

    sample_id: str
    index: int
    group_index: int
    dataset: str
    carried_from: str | None = None
    attempt: int = -1
    turns: int = 0
    outcome: int = PENDING
    terminal_attempt: int = -1
    reward: float = 0.0
    finished: bool = False
    failure_class: FailureClass = FailureClass.INFRA_OTHER
    abort_class: AbortClass | None = None
    response_length: int = 0
    n_sampled: int = 0  # sampled (loss-masked) tokens
    low_version: int = 0  # the oldest weight version among them (-1: unknown)
    spread: tuple[tuple[int, int], ...] | None = None  # per version, when more than one
    scored: bool = False
    ce: tuple[CeChunk, ...] | None = None

    @property
    def done(self) -> bool:
        return self.outcome != PENDING

    @property
    def completed(self) -> bool:
        return self.outcome == COMPLETED

    @property
    def aborted(self) -> bool:
        return self.outcome == ABORTED

    @property
    def correct(self) -> bool:
        return self.failure_class.correct

    @property
    def versions(self) -> tuple[tuple[int, int], ...]:
        """Sampled tokens per weight version, ascending (``-1``: recorded without one)."""
        if self.spread is not None:
            return self.spread
        return ((self.low_version, self.n_sampled),) if self.n_sampled else ()


@dataclass(slots=True)
class DecisionState:
    rollout_id: str | None = None
    request: RolloutRequested | None = None
    samples: dict[str, Brief] = field(default_factory=dict)
    planned: RolloutPlanned | None = None
    ready: RolloutReady | None = None
    failed: RolloutFailed | None = None
    capture: CaptureRequested | None = None
    # prompt key -> its length in tokens (the CE lane's sub-sample sizes need it)
    prompts: dict[str, int] = field(default_factory=dict)
    # Whole tasks, only for a request whose tail may be carried (TailCarried repeats them).
    tasks: dict[str, TaskFetched] = field(default_factory=dict)
    # Per rollout a carried sample runs in, this rollout's carried sample ids.
    carried: dict[str, set[str]] = field(default_factory=dict)
    event_count: int = 0
    n_terminal: int = 0
    n_scored: int = 0
    group_size: dict[int, int] = field(default_factory=dict)
    group_done: dict[int, int] = field(default_factory=dict)
    completed_groups: list[int] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        return self.ready is not None or self.failed is not None

    def all_terminal(self) -> bool:
        if self.planned is None or len(self.samples) < self.planned.n_samples:
            return False
        return self.n_terminal >= len(self.samples)

    def ordered(self) -> list[Brief]:
        """Samples in task order (index), the order the trainer sees."""
        return sorted(self.samples.values(), key=lambda b: b.index)


def _keeps_tasks(request: RolloutRequested | None) -> bool:
    """Whether the fold keeps whole tasks: a tail may be carried (or the request is not
    known yet, so nothing rules it out)."""
    return request is None or (
        request.tail == "carry" and request.n_planned_prompts > request.n_prompts
    )


def _wants_ce(request: RolloutRequested | None) -> bool:
    return request is None or request_lane(request) is Lane.CE


def _versions(done: SampleCompleted) -> tuple[tuple[int, int], ...]:
    """Sampled tokens per weight version, ascending (engine.actors.finalizer's
    ``_sampled_versions``, counted)."""
    return _versions_of(done.loss_mask.data, done.token_versions.data)


def _versions_of(mask: bytes, tv: bytes) -> tuple[tuple[int, int], ...]:
    """:func:`_versions` from the raw bytes of the loss mask (uint8) and the token versions
    (int32, little-endian).

    The common trajectory -- every token of one version, or none recorded -- is counted on
    the bytes (a sampled token is a non-zero mask byte); anything else, including arrays of
    different lengths (which numpy's boolean index refuses), takes numpy."""
    n_tokens = len(mask)
    n = n_tokens - mask.count(0)
    if not tv:
        return ((UNKNOWN_VERSION, n),) if n else ()
    if len(tv) == 4 * n_tokens and tv == tv[:4] * n_tokens:  # one version throughout
        return ((int.from_bytes(tv[:4], "little", signed=True), n),) if n else ()
    sampled = np.frombuffer(mask, dtype=np.uint8).astype(bool)
    versions = np.frombuffer(tv, dtype="<i4")[sampled].astype(np.int64)
    if not len(versions):
        return ()
    low, high = int(versions.min()), int(versions.max())
    if low == high:
        return ((low, len(versions)),)
    values, counts = np.unique(versions, return_counts=True)
    return tuple(zip(values.tolist(), counts.tolist(), strict=True))


def _opened(state: DecisionState, sample_id: str, attempt: int) -> Brief | None:
    """The sample a terminal event of ``attempt`` closes, its attempt recorded; None when
    it is unknown or already terminal (the first terminal wins)."""
    b = state.samples.get(sample_id)
    if b is None or b.done:
        return None
    if attempt != b.attempt:
        b.turns = 0  # a terminal of another attempt: its turns are not recorded
    b.attempt = max(b.attempt, attempt)
    b.terminal_attempt = attempt
    return b


def _closed(state: DecisionState, b: Brief) -> None:
    state.n_terminal += 1
    g = b.group_index
    done = state.group_done[g] = state.group_done.get(g, 0) + 1
    if done == state.group_size.get(g, 0):
        state.completed_groups.append(g)


def _started(state: DecisionState, sample_id: str, attempt: int) -> None:
    b = state.samples.get(sample_id)
    if b is not None and not b.done and attempt >= b.attempt:
        if attempt != b.attempt:
            b.turns = 0  # a re-run starts afresh
        b.attempt = attempt


def _turn(state: DecisionState, sample_id: str, attempt: int) -> None:
    b = state.samples.get(sample_id)
    if b is not None and not b.done and attempt == b.attempt:
        b.turns += 1


class DecisionProjection:
    """Folds one rollout stream into a :class:`DecisionState`."""

    name = "decision"

    def __init__(self) -> None:
        self._datasets: dict[str, str] = {}  # one string object per dataset name
        # _wants_ce of the last request asked about (asked once per completed sample)
        self._ce_of: tuple[RolloutRequested | None, bool] = (None, _wants_ce(None))

    def _wants_ce(self, request: RolloutRequested | None) -> bool:
        known, wants = self._ce_of
        if request is not known:
            wants = _wants_ce(request)
            self._ce_of = (request, wants)
        return wants

    def initial(self) -> DecisionState:
        return DecisionState()

    def _task(self, state: DecisionState, ev: TaskFetched | TaskJoined) -> None:
        if isinstance(ev, TaskJoined):
            self._joined(state, ev)
        elif ev.sample_id not in state.samples:
            dataset = self._datasets.setdefault(ev.dataset, ev.dataset)
            self._add(state, ev, dataset, ev.carried_from, ev)

    def _joined(self, state: DecisionState, ev: TaskJoined) -> None:
        """A joined sample (the event, or its flat fields: then no whole task is kept)."""
        if ev.sample_id in state.samples:
            return
        first = state.samples.get(ev.same_as)
        if first is None:
            raise RolloutError(
                f"TaskJoined {ev.sample_id} (rollout {ev.rollout_id}) refers to sample "
                f"{ev.same_as!r}, whose TaskFetched no earlier entry of the stream holds"
            )
        whole = state.tasks.get(ev.same_as)
        task = ev.task(whole) if whole is not None else None
        self._add(state, ev, first.dataset, first.carried_from, task)  # group fields

    def _add(
        self,
        state: DecisionState,
        ev: TaskFetched | TaskJoined,
        dataset: str,
        carried_from: str | None,
        task: TaskFetched | None,
    ) -> None:
        state.samples[ev.sample_id] = Brief(
            sample_id=ev.sample_id,
            index=ev.index,
            group_index=ev.group_index,
            dataset=dataset,
            carried_from=carried_from,
        )
        if task is not None and _keeps_tasks(state.request):
            state.tasks[ev.sample_id] = task
        if carried_from is not None:
            state.carried.setdefault(carried_from, set()).add(ev.sample_id)
        state.rollout_id = state.rollout_id or ev.rollout_id
        g = ev.group_index
        state.group_size[g] = state.group_size.get(g, 0) + 1

    def _terminal(self, state: DecisionState, ev: SampleCompleted | SampleAborted) -> None:
        if isinstance(ev, SampleCompleted):
            self._completed(
                state, ev, len(ev.prompt_ids), len(ev.response_ids), ev.loss_mask.data,
                ev.token_versions.data, ev,
            )
            return
        b = _opened(state, ev.sample_id, ev.attempt)
        if b is None:
            return
        abort = ev.abort_class
        b.outcome = ABORTED
        b.failure_class = abort.failure_class
        b.abort_class = abort
        b.turns = ev.turns
        _closed(state, b)

    def _completed(
        self,
        state: DecisionState,
        ev: SampleCompleted,
        n_prompt: int,
        n_response: int,
        mask: bytes,
        token_versions: bytes,
        whole: SampleCompleted | None,
    ) -> None:
        """A ``SampleCompleted``: ``ev`` is the event (``whole`` too) or its flat fields
        (``whole`` None: only for a request that needs no CE chunks), with its prompt and
        response lengths and the raw bytes of its loss mask and token versions."""
        b = _opened(state, ev.sample_id, ev.attempt)
        if b is None:
            return
        prompt_len = n_prompt
        if ev.prompt_key:
            stored = state.prompts.get(ev.prompt_key)
            if stored is None:
                raise RolloutError(
                    f"SampleCompleted {ev.sample_id} (rollout {ev.rollout_id}) refers to "
                    f"prompt {ev.prompt_key!r}, which no earlier PromptStored of the "
                    "stream holds"
                )
            prompt_len = stored
        reason = ev.termination_reason
        b.outcome = COMPLETED
        b.reward = float(ev.reward)
        b.finished = reason == _FINISH
        b.failure_class = FailureClass.of(ev.reward, reason)
        b.turns = ev.n_turns or b.turns
        b.response_length = n_response
        versions = _versions_of(mask, token_versions)
        if versions:
            b.low_version = versions[0][0]
            b.n_sampled = sum(n for _, n in versions)
            b.spread = versions if len(versions) > 1 else None
        if whole is not None and self._wants_ce(state.request):
            shift = prompt_len - n_prompt
            b.ce = tuple(
                replace(c, n_tokens=c.n_tokens + shift) if shift else c
                for c in ce_chunks(whole)
            )
        _closed(state, b)

    def evolve(self, state: DecisionState, env: Envelope) -> DecisionState:
        ev = env.event
        state.event_count += 1
        if isinstance(ev, TaskFetched | TaskJoined):
            self._task(state, ev)
        elif isinstance(ev, SampleStarted):
            _started(state, ev.sample_id, ev.attempt)
        elif isinstance(ev, TurnCompleted):
            _turn(state, ev.sample_id, ev.attempt)
        elif isinstance(ev, SampleCompleted | SampleAborted):
            self._terminal(state, ev)
        elif isinstance(ev, TeacherScored):
            b = state.samples.get(ev.sample_id)
            if (
                b is not None
                and b.completed
                and b.terminal_attempt == ev.attempt
                and not b.scored
            ):
                b.scored = True
                state.n_scored += 1
        elif isinstance(ev, PromptStored):
            state.prompts.setdefault(ev.prompt_key, len(ev.prompt_ids))
        elif isinstance(ev, RolloutPlanned):
            if state.planned is None:
                state.planned = ev
        elif isinstance(ev, RolloutRequested):
            if state.request is None:
                state.request = ev
                state.rollout_id = ev.rollout_id
                if not _keeps_tasks(ev):
                    state.tasks.clear()
        elif isinstance(ev, RolloutReady):
            if state.ready is None:
                state.ready = ev
        elif isinstance(ev, RolloutFailed):
            if state.failed is None:
                state.failed = ev
        elif isinstance(ev, CaptureRequested):
            if state.capture is None:
                state.capture = ev
        return state

    def evolve_flat(self, state: DecisionState, cls: type[Event], fields: Any) -> bool:
        """Fold one event from its checked fields (``codec.decode_flat``), without the
        event: what :meth:`evolve` does with it, for the events that make most of a stream
        (``SampleStarted``, ``TurnCompleted``, ``SampleCompleted`` when the request needs no
        CE chunks, and ``TaskJoined`` when no whole task is kept). Returns False, changing
        nothing, for any other event: the caller decodes that one and folds it with
        :meth:`evolve`."""
        if cls is SampleStarted:
            state.event_count += 1
            _started(state, fields.sample_id, fields.attempt)
        elif cls is TurnCompleted:
            state.event_count += 1
            _turn(state, fields.sample_id, fields.attempt)
        elif cls is SampleCompleted and not self._wants_ce(state.request):
            state.event_count += 1
            mask = fields.loss_mask  # compact: checked by decode_flat
            self._completed(
                state,
                fields,
                compact_size(TokenIds, fields.prompt_ids),
                compact_size(TokenIds, fields.response_ids),
                mask[1:] if mask[0] == 0 else from_compact(Mask, mask).data,
                fields.token_versions,
                None,
            )
        elif cls is TaskJoined and not _keeps_tasks(state.request):
            state.event_count += 1
            self._joined(state, fields)  # state.tasks is empty: no whole task to build
        else:
            return False
        return True


# ---------------------------------------------------------------- decisions


def groups_needed(state: DecisionState) -> int | None:
    """Whole groups an over-provisioned training rollout becomes ready with (its request's
    ``n_prompts``); None: the rollout waits for every planned sample."""
    request = state.request
    if request is None or request.kind is not RolloutKind.TRAIN:
        return None
    if request.n_planned_prompts <= request.n_prompts:
        return None
    return request.n_prompts


def worth_deciding(state: DecisionState) -> bool:
    """A cheap test, from the counters, that a decision may be due (the finalizer's
    ``worth_deciding``)."""
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

    samples: list[Brief]
    tail: list[str]


def select_groups(state: DecisionState) -> Selection | None:
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
        [b for b in ordered if b.group_index in chosen],
        [b.sample_id for b in ordered if b.group_index not in chosen],
    )


def stale_split(
    samples: list[Brief], floor: int | None
) -> tuple[list[Brief], list[Brief], int]:
    """``(fresh, stale, stale_tokens)`` under the staleness bound ``floor`` (a completed
    sample with a sampled token older than ``floor`` or of unknown version is stale; so is
    one the worker ended as ``stale``)."""
    if floor is None:
        return samples, [], 0
    fresh: list[Brief] = []
    stale: list[Brief] = []
    tokens = 0
    for b in samples:
        if b.aborted:
            (stale if b.abort_class is AbortClass.STALE else fresh).append(b)
            continue
        if not b.completed or not b.n_sampled:
            fresh.append(b)
            continue
        low = b.low_version
        if low < 0 or low < floor:
            stale.append(b)
            tokens += b.n_sampled
        else:
            fresh.append(b)
    return fresh, stale, tokens


def apply_filters(
    state: DecisionState, samples: list[Brief] | None = None
) -> tuple[list[str], list[str]]:
    """``(kept, dropped)`` ids in index order: reward-based rejection, then finish-only."""
    filters = state.request.filters if state.request is not None else FilterSpec()
    ordered = state.ordered() if samples is None else samples
    kept = ordered
    if filters.reject_equal_rewards:
        rewards: dict[int, set[float]] = defaultdict(set)
        for b in ordered:
            rewards[b.group_index].add(b.reward)
        kept = [b for b in kept if len(rewards[b.group_index]) > 1]
    if filters.finish_only:
        kept = [b for b in kept if b.completed and b.finished]
    kept_ids = {b.sample_id for b in kept}
    dropped = [b.sample_id for b in ordered if b.sample_id not in kept_ids]
    return [b.sample_id for b in kept], dropped


def _unscored(state: DecisionState, kept: list[str]) -> list[str]:
    return [
        sid for sid in kept if (b := state.samples[sid]).completed and not b.scored
    ]


def decide_capture(
    state: DecisionState, *, top_k: int = 20, trainer_version: int | None = None
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


def route(state: DecisionState, kept: list[str], dropped: list[str]) -> Routed:
    """The lanes' routing (:func:`engine.projections.lanes.route`) from the compact state:
    the CE lane drops trajectories with an over-long sub-sample whole and reports its
    ``gbs_scale``; every other lane changes nothing."""
    request = state.request
    if request_lane(request) is not Lane.CE:
        return Routed(kept=kept, dropped=dropped)
    plan = plan_ce(
        request,
        (
            (sid, b.ce or ())
            for sid in kept
            if (b := state.samples.get(sid)) is not None and b.completed
        ),
    )
    gone = set(plan.too_long)
    samples = state.samples

    def index(sid: str) -> int:
        b = samples.get(sid)
        return b.index if b is not None else 0

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
    state: DecisionState,
    kept: list[str],
    dropped: list[str],
    samples: list[Brief] | None = None,
) -> dict[str, float]:
    """Counts, reward statistics, failure-class counts and per-dataset eval metrics."""
    chosen = state.ordered() if samples is None else samples
    n = len(chosen)
    completed = [b for b in chosen if b.completed]
    out: dict[str, float] = {
        "n_samples": float(n),
        "n_kept": float(len(kept)),
        "n_dropped": float(len(dropped)),
        "n_completed": float(len(completed)),
        "n_aborted": float(n - len(completed)),
        "reward_mean": sum(b.reward for b in chosen) / n if n else 0.0,
        "abort_rate": (n - len(completed)) / n if n else 0.0,
        "response_length_mean": (
            sum(b.response_length for b in completed) / len(completed) if completed else 0.0
        ),
    }
    counts = Counter(b.failure_class for b in chosen)
    for cls in FailureClass:
        count = counts.get(cls, 0)
        if count or not cls.engine_ended:
            out[f"class/{cls.value}"] = float(count)
    kind = state.request.kind if state.request is not None else RolloutKind.TRAIN
    prefix = "eval" if kind is RolloutKind.EVAL else "rollout"
    out.update(rows_metrics(chosen, prefix=prefix))
    return out


def version_spread(state: DecisionState, kept: list[str]) -> dict[str, int]:
    """Sampled tokens of the kept completed samples per weight version (as strings)."""
    counts: Counter[int] = Counter()
    for sid in kept:
        b = state.samples.get(sid)
        if b is None or not b.completed:
            continue
        counts.update(dict(b.versions))
    return {str(v): counts[v] for v in sorted(counts)}


def decide_ready(state: DecisionState, trainer_version: int | None = None) -> RolloutReady | None:
    """The rollout's ``RolloutReady``, or None while it is not ready (or already decided):
    the finalizer's ``decide_ready``, from the compact state."""
    if state.decided:
        return None
    selection = select_groups(state)
    if selection is None:
        return None
    request = state.request
    floor = staleness_floor(request, trainer_version)
    fresh, stale, stale_tokens = stale_split(selection.samples, floor)
    kept, dropped = apply_filters(state, fresh)
    if needs_teacher(request) and _unscored(state, kept):
        return None
    routed = route(state, kept, dropped)
    kept, dropped = routed.kept, routed.dropped
    chosen = selection.samples
    n_completed = sum(1 for b in chosen if b.completed)
    metrics = {**ready_metrics(state, kept, dropped, chosen), **(routed.metrics or {})}
    current = None
    if floor is not None:
        assert request is not None and request.max_staleness is not None
        current = floor + request.max_staleness
        metrics["n_stale"] = float(len(stale))
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
        stale_sample_ids=[b.sample_id for b in stale],
        stale_tokens=stale_tokens,
        tail_sample_ids=selection.tail,
        tail_carried=bool(selection.tail) and request is not None and request.tail == "carry",
    )


def carried_sources(state: DecisionState) -> dict[str, set[str]]:
    """Per rollout a carried sample runs in, this rollout's carried sample ids (kept as the
    tasks are folded: no scan)."""
    return {src: set(ids) for src, ids in state.carried.items()}


def tail_carried(state: DecisionState, ready: RolloutReady) -> TailCarried | None:
    """The ``TailCarried`` (for ``rl:data``) of a rollout ready with a carried tail."""
    request = state.request
    if not ready.tail_carried or request is None or request.request_stream is None:
        return None
    return TailCarried(
        rollout_id=ready.rollout_id,
        request_stream=request.request_stream,
        tasks=[state.tasks[sid] for sid in ready.tail_sample_ids],
    )


def tail_aborts(state: DecisionState, ready: RolloutReady) -> list[SampleAborted]:
    """The ``SampleAborted`` (``tail_aborted``) of every tail sample still without a
    terminal event, for a request whose tail is aborted (index order)."""
    if not ready.tail_sample_ids or ready.tail_carried:
        return []
    out: list[SampleAborted] = []
    for sid in ready.tail_sample_ids:
        b = state.samples[sid]
        if b.done:
            continue
        out.append(
            SampleAborted(
                rollout_id=ready.rollout_id,
                sample_id=sid,
                attempt=max(b.attempt, 0),
                abort_class=AbortClass.TAIL_ABORTED,
                error=(
                    "tail of an over-provisioned rollout: it became ready with "
                    f"{len(ready.sample_ids) + len(ready.dropped_sample_ids)} samples of its "
                    "first whole groups"
                ),
                turns=b.turns,
            )
        )
    return out


# ---------------------------------------------------------------- summary.json


class _TailRow(NamedTuple):
    """A tail sample's row as ``summary.json`` lists it (engine.projections.rows)."""

    sample_id: str
    dataset: str
    group_index: int
    reward: float
    failure_class: FailureClass
    turns: int

    @property
    def correct(self) -> bool:
        return self.failure_class.correct


def build_summary(state: DecisionState) -> dict[str, Any]:
    """``summary.json`` from the compact state: the same dict
    :func:`engine.projections.summary.build_summary` builds from the full one."""
    ready = state.ready
    ordered = state.ordered()
    rows: Sequence[Brief | _TailRow] = ordered
    if ready is not None and ready.tail_sample_ids and not ready.tail_carried:
        tail = set(ready.tail_sample_ids)
        rows = [
            _TailRow(b.sample_id, b.dataset, b.group_index, b.reward,
                     FailureClass.TAIL_ABORTED, b.turns)
            if b.sample_id in tail and not b.done else b
            for b in ordered
        ]
    return summary_of(rows, rollout_id=state.rollout_id, request=state.request, ready=ready)
