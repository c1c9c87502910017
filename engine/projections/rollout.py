"""The fold of a rollout stream: one compact record per sample, the only fold of the stream.

``rl:{rollout:<id>}`` starts with a copy of the ``RolloutRequested`` (so an archived stream is
self-contained), then ``TaskFetched`` (or ``TaskJoined``) per sample, ``BatchSealed`` per
batch and one ``RolloutPlanned``, the samples' lifecycle events, optional
``CaptureRequested`` and ``TeacherScored`` and finally ``RolloutReady``.

Each sample is a :class:`SampleRecord`: its outcome, reward, group, attempt, turn count,
token counts per weight version, where it runs, and the entry ids (positions in the stream)
of what the whole sample is built from -- its task entry, its terminal entry, its teacher
scoring, its stored prompt and the turns of the attempt that ended it. The finalizer
decides from the records; the trainer's samples and the artifacts are built by reading
those entries back (:mod:`engine.projections.readback`), never from a second fold.

The rules, once (at-least-once delivery, crashed and retried workers):

* the first ``TaskFetched`` of a sample id wins; a ``TaskJoined`` stands for its group's
  first task (``same_as``, which an earlier entry must hold);
* ``SampleStarted`` raises the sample's attempt, never lowers it; a higher attempt starts
  its turns afresh; ``TurnCompleted`` counts for the current attempt only;
* the first terminal event (``SampleCompleted`` or ``SampleAborted``) of a known sample wins,
  whatever its attempt; its turns are the current attempt's, none when it ended another;
* ``TeacherScored`` counts for the terminal attempt of a completed sample, once;
* ``PromptStored`` keeps the first prompt of each key; a ``SampleCompleted`` that refers to
  one (``prompt_key``) must come after it;
* the first ``RolloutRequested``, ``RolloutPlanned``, ``CaptureRequested``, ``RolloutReady``
  and ``RolloutFailed`` win, and the first ``BatchSealed`` of each batch id;
* groups become whole (every sample terminal) in log order (``completed_groups``).

A writer's error (a joined task or a prompt no earlier entry holds) raises
:class:`~engine.errors.RolloutError` naming the reference.

The state is an accumulator: ``evolve`` updates it in place and returns it (folding a
1M-sample rollout must stay linear), so the fold owns it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engine.errors import RolloutError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    BatchSealed,
    CaptureRequested,
    PromptStored,
    RolloutFailed,
    RolloutPlanned,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.events.ids import parse_id
from engine.outcomes import AbortClass, FailureClass, SampleStatus, TerminationReason
from engine.projections.lanes import CeChunk, Lane, ce_chunks, request_lane

__all__ = [
    "MARK_EVERY",
    "UNKNOWN_VERSION",
    "RolloutProjection",
    "RolloutState",
    "SampleRecord",
    "joined_task",
    "staleness_floor",
    "version_meets",
    "versions_of",
    "with_prompt",
]

MARK_EVERY = 32
"""The fold marks every ``MARK_EVERY``-th entry it folds, so that reading entries back can
tell which of them lie close together in the stream (one range read for them)."""

UNKNOWN_VERSION = -1  # engine.agents.result.UNKNOWN_VERSION (projections import no agents)
_PENDING, _ABORTED = SampleStatus.PENDING, SampleStatus.ABORTED


@dataclass(slots=True)
class SampleRecord:
    """One sample as the fold knows it (see the module docstring).

    ``turns`` is the turn count of the current attempt while the sample runs, and from its
    terminal event on the count its rows report (``SampleCompleted.n_turns`` or the turns
    recorded; ``SampleAborted.turns``). ``worker``, ``node`` and ``batch_id`` are those of
    the last start (``worker`` None: never started). The sampled tokens' weight versions are
    a count and the oldest version, with the per-version counts only when they differ
    (:attr:`versions`). ``*_at`` are entry ids of the stream."""

    sample_id: str
    index: int
    group_index: int
    dataset: str
    carried_from: str | None
    task_at: str  # its TaskFetched or TaskJoined
    root_at: str  # the TaskFetched its task is built from (its group's first, if joined)
    attempt: int = -1
    turns: int = 0
    turn_at: tuple[str, ...] = ()  # the TurnCompleted of the current attempt
    worker: str | None = None
    node: str = ""
    batch_id: str = ""
    status: SampleStatus = SampleStatus.PENDING
    reason: TerminationReason | None = None  # an abort's: its class's reason
    abort_class: AbortClass | None = None
    failure_class: FailureClass = FailureClass.INFRA_OTHER
    terminal_attempt: int = -1
    terminal_at: str | None = None
    prompt_at: str | None = None  # the PromptStored its trajectory refers to
    teacher_at: str | None = None  # its TeacherScored
    reward: float = 0.0
    response_length: int = 0
    n_sampled: int = 0  # sampled (loss-masked) tokens
    low_version: int = 0  # the oldest weight version among them (-1: unknown)
    spread: tuple[tuple[int, int], ...] | None = None  # per version, when more than one
    ce: tuple[CeChunk, ...] | None = None  # the CE lane's sub-samples

    @property
    def done(self) -> bool:
        return self.status is not _PENDING

    @property
    def completed(self) -> bool:
        """The first terminal event is a ``SampleCompleted``."""
        return self.status is not _PENDING and self.status is not _ABORTED

    @property
    def aborted(self) -> bool:
        return self.status is _ABORTED

    @property
    def started(self) -> bool:
        return self.worker is not None

    @property
    def scored(self) -> bool:
        return self.teacher_at is not None

    @property
    def finished(self) -> bool:
        """Completed with a clean ``finish``."""
        return self.reason is TerminationReason.FINISH and self.completed

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
class RolloutState:
    rollout_id: str | None = None
    request: RolloutRequested | None = None
    samples: dict[str, SampleRecord] = field(default_factory=dict)
    batches: dict[str, BatchSealed] = field(default_factory=dict)
    planned: RolloutPlanned | None = None
    ready: RolloutReady | None = None
    failed: RolloutFailed | None = None
    capture: CaptureRequested | None = None
    prompts: dict[str, tuple[str, int]] = field(default_factory=dict)  # key: (entry, length)
    # Per rollout a carried sample runs in, this rollout's carried sample ids.
    carried: dict[str, set[str]] = field(default_factory=dict)
    ce: bool = True  # the CE lane's sub-samples are recorded (the request's lane, once known)
    n_entries: int = 0  # entries folded
    marks: list[tuple[int, int]] = field(default_factory=list)  # every MARK_EVERY-th, parsed
    n_terminal: int = 0
    n_scored: int = 0
    # Per group index: its samples and how many are terminal; ``completed_groups`` lists
    # groups in the order they became whole, which is log order -- the order a partial
    # rollout takes its first ``n_prompts`` groups in.
    group_size: dict[int, int] = field(default_factory=dict)
    group_done: dict[int, int] = field(default_factory=dict)
    completed_groups: list[int] = field(default_factory=list)

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def decided(self) -> bool:
        """The rollout has its outcome: ``RolloutReady`` or ``RolloutFailed``."""
        return self.ready is not None or self.failed is not None

    def pending(self, sample_ids: Iterable[str] | None = None) -> list[str]:
        """Sample ids (of those given, or all) that have no terminal event yet."""
        ids = self.samples.keys() if sample_ids is None else sample_ids
        return [i for i in ids if i in self.samples and not self.samples[i].done]

    def all_terminal(self) -> bool:
        """The plan is complete and every planned sample has a terminal event."""
        if self.planned is None or len(self.samples) < self.planned.n_samples:
            return False
        return self.n_terminal >= len(self.samples)

    def ordered(self) -> list[SampleRecord]:
        """Samples in task order (index), the order the trainer sees."""
        return sorted(self.samples.values(), key=lambda r: r.index)


class RolloutProjection:
    """Folds one rollout stream into a :class:`RolloutState` (see the module docstring)."""

    name = "rollout"

    def __init__(self) -> None:
        self._names: dict[str, str] = {}  # one string object per dataset, worker, node, batch
        self._on: dict[type[Event], Callable[[RolloutState, Any, str], None]] = {
            TaskFetched: self._task,
            TaskJoined: self._joined,
            SampleStarted: self._start,
            TurnCompleted: _turn,
            SampleCompleted: _completed,
            SampleAborted: _aborted,
            TeacherScored: _teacher,
            PromptStored: _prompt,
            BatchSealed: _batch,
            RolloutPlanned: _planned,
            RolloutRequested: _requested,
            RolloutReady: _ready,
            RolloutFailed: _failed,
            CaptureRequested: _capture,
        }

    def initial(self) -> RolloutState:
        return RolloutState()

    def evolve(self, state: RolloutState, env: Envelope) -> RolloutState:
        at = env.id
        n = state.n_entries
        if not n % MARK_EVERY:
            state.marks.append(parse_id(at))
        state.n_entries = n + 1
        on = self._on.get(type(env.event))
        if on is not None:
            on(state, env.event, at)
        return state

    def fold_checked(self, state: RolloutState, at: str, cls: type[Event], fields: Any) -> bool:
        """Fold entry ``at`` from its checked fields (``fastpath.checked``: the values of its
        event, which is not built) as :meth:`evolve` folds the event, for the events a
        stream is mostly made of; False, changing nothing, for any other class (the caller
        decodes that entry and folds it with :meth:`evolve`)."""
        if cls not in _FROM_FIELDS:
            return False
        n = state.n_entries
        if not n % MARK_EVERY:
            state.marks.append(parse_id(at))
        state.n_entries = n + 1
        self._on[cls](state, fields, at)
        return True

    def _name(self, text: str) -> str:
        return self._names.setdefault(text, text)

    def _task(self, state: RolloutState, ev: TaskFetched, at: str) -> None:
        if ev.sample_id not in state.samples:
            _add(state, ev, self._name(ev.dataset), ev.carried_from, at, at)

    def _joined(self, state: RolloutState, ev: TaskJoined, at: str) -> None:
        if ev.sample_id in state.samples:
            return
        first = state.samples.get(ev.same_as)
        if first is None:
            raise RolloutError(
                f"TaskJoined {ev.sample_id} (rollout {ev.rollout_id}) refers to sample "
                f"{ev.same_as!r}, whose TaskFetched no earlier entry of the stream holds"
            )
        _add(state, ev, first.dataset, first.carried_from, at, first.root_at)

    def _start(self, state: RolloutState, ev: SampleStarted, at: str) -> None:
        r = state.samples.get(ev.sample_id)
        if r is None or r.status is not _PENDING or ev.attempt < r.attempt:
            return
        if ev.attempt != r.attempt:  # a re-run starts afresh
            r.attempt, r.turns, r.turn_at = ev.attempt, 0, ()
        names = self._names
        r.worker = names.setdefault(ev.worker, ev.worker)
        r.node = names.setdefault(ev.node, ev.node)
        r.batch_id = names.setdefault(ev.batch_id, ev.batch_id)


# The events whose handlers read only their fields' values (never keep the event), so they
# fold from checked fields alike.
_FROM_FIELDS = frozenset(
    {TaskJoined, SampleStarted, TurnCompleted, SampleCompleted, SampleAborted, TeacherScored}
)


def _add(
    state: RolloutState,
    ev: TaskFetched | TaskJoined,
    dataset: str,
    carried_from: str | None,
    at: str,
    root_at: str,
) -> None:
    sid = ev.sample_id
    state.samples[sid] = SampleRecord(
        sid, ev.index, ev.group_index, dataset, carried_from, at, root_at
    )
    if carried_from is not None:
        state.carried.setdefault(carried_from, set()).add(sid)
    state.rollout_id = state.rollout_id or ev.rollout_id
    g = ev.group_index
    state.group_size[g] = state.group_size.get(g, 0) + 1


def _turn(state: RolloutState, ev: TurnCompleted, at: str) -> None:
    r = state.samples.get(ev.sample_id)
    if r is not None and r.status is _PENDING and ev.attempt == r.attempt:
        r.turns += 1
        r.turn_at = (*r.turn_at, at)


def _opened(
    state: RolloutState, ev: SampleCompleted | SampleAborted, at: str
) -> SampleRecord | None:
    """The sample a terminal event closes, its attempt recorded; None when it is unknown or
    already terminal (the first terminal wins)."""
    r = state.samples.get(ev.sample_id)
    if r is None or r.status is not _PENDING:
        return None
    attempt = ev.attempt
    if attempt != r.attempt:  # a terminal of another attempt: its turns are not recorded
        r.turns, r.turn_at = 0, ()
        if attempt > r.attempt:
            r.attempt = attempt
    r.terminal_attempt = attempt
    r.terminal_at = at
    return r


def _closed(state: RolloutState, r: SampleRecord) -> None:
    state.n_terminal += 1
    g = r.group_index
    done = state.group_done[g] = state.group_done.get(g, 0) + 1
    if done == state.group_size.get(g, 0):
        state.completed_groups.append(g)


def _completed(state: RolloutState, ev: SampleCompleted, at: str) -> None:
    r = _opened(state, ev, at)
    if r is None:
        return
    shift = 0  # the stored prompt's tokens, which the event does not carry
    if ev.prompt_key:
        stored = state.prompts.get(ev.prompt_key)
        if stored is None:
            raise RolloutError(
                f"SampleCompleted {ev.sample_id} (rollout {ev.rollout_id}) refers to prompt "
                f"{ev.prompt_key!r}, which no earlier PromptStored of the stream holds"
            )
        r.prompt_at = stored[0]
        shift = stored[1] - len(ev.prompt_ids)
    reason = ev.termination_reason
    r.status = ev.status
    r.reason = reason
    r.reward = reward = float(ev.reward)
    r.failure_class = FailureClass.of(reward, reason)
    r.turns = ev.n_turns or r.turns
    r.response_length = len(ev.response_ids)
    versions = versions_of(ev.loss_mask.data, ev.token_versions.data)
    if versions:
        r.low_version = versions[0][0]
        r.n_sampled = sum(n for _, n in versions) if len(versions) > 1 else versions[0][1]
        r.spread = versions if len(versions) > 1 else None
    if state.ce:
        r.ce = tuple(
            replace(c, n_tokens=c.n_tokens + shift) if shift else c for c in ce_chunks(ev)
        )
    _closed(state, r)


def _aborted(state: RolloutState, ev: SampleAborted, at: str) -> None:
    r = _opened(state, ev, at)
    if r is None:
        return
    abort = ev.abort_class
    r.status = _ABORTED
    r.abort_class = abort
    r.reason = abort.reason
    r.failure_class = abort.failure_class
    r.turns = ev.turns
    _closed(state, r)


def _teacher(state: RolloutState, ev: TeacherScored, at: str) -> None:
    r = state.samples.get(ev.sample_id)
    if (
        r is not None
        and r.teacher_at is None
        and r.terminal_attempt == ev.attempt
        and r.completed
    ):
        r.teacher_at = at
        state.n_scored += 1


def _prompt(state: RolloutState, ev: PromptStored, at: str) -> None:
    state.prompts.setdefault(ev.prompt_key, (at, len(ev.prompt_ids)))


def _batch(state: RolloutState, ev: BatchSealed, at: str) -> None:
    state.batches.setdefault(ev.batch_id, ev)


def _planned(state: RolloutState, ev: RolloutPlanned, at: str) -> None:
    if state.planned is None:
        state.planned = ev


def _requested(state: RolloutState, ev: RolloutRequested, at: str) -> None:
    if state.request is None:
        state.request = ev
        state.rollout_id = ev.rollout_id
        state.ce = request_lane(ev) is Lane.CE


def _ready(state: RolloutState, ev: RolloutReady, at: str) -> None:
    if state.ready is None:
        state.ready = ev


def _failed(state: RolloutState, ev: RolloutFailed, at: str) -> None:
    if state.failed is None:
        state.failed = ev


def _capture(state: RolloutState, ev: CaptureRequested, at: str) -> None:
    if state.capture is None:
        state.capture = ev


def versions_of(mask: bytes, tv: bytes) -> tuple[tuple[int, int], ...]:
    """Sampled tokens per weight version, ascending, from the raw bytes of a trajectory's
    loss mask (uint8) and token versions (int32, little-endian; empty: none recorded, each
    sampled token then counts as version -1).

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


# ---------------------------------------------------------------- whole samples


def joined_task(entry: TaskFetched | TaskJoined, root: TaskFetched) -> TaskFetched:
    """A sample's whole task from its task entry and the ``TaskFetched`` the fold recorded
    as its root (the entry itself when it is whole)."""
    return entry if isinstance(entry, TaskFetched) else entry.task(root)


def with_prompt(done: SampleCompleted, stored: PromptStored) -> SampleCompleted:
    """A trajectory that refers to a stored prompt (``prompt_key``) with the prompt tokens
    filled in from the ``PromptStored`` the fold recorded for it."""
    return done.model_copy(update={"prompt_ids": stored.prompt_ids})


def staleness_floor(request: RolloutRequested | None, trainer_version: int | None) -> int | None:
    """The oldest weight version a sampled token of the rollout may come from: the trainer's
    current version minus ``request.max_staleness`` (None: the request sets no bound).
    ``trainer_version`` is the highest published version (None: none published); the
    request's own ``policy_version`` counts when higher."""
    if request is None or request.max_staleness is None:
        return None
    current = request.policy_version
    if trainer_version is not None and trainer_version > current:
        current = trainer_version
    return current - request.max_staleness


def version_meets(version: int, floor: int | None) -> bool:
    """Whether a token of weight ``version`` meets the bound ``floor``. A token of unknown
    version (-1: the server reported none) never meets a bound: nothing shows its weights
    were recent enough, so a bounded rollout does not train on it."""
    return floor is None or (version >= 0 and version >= floor)
