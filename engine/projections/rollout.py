"""The rollout projection: everything known about one rollout, folded from its stream.

``rl:{rollout:<id>}`` starts with a copy of the ``RolloutRequested`` (so an archived stream is
self-contained), then ``TaskFetched`` per sample, ``BatchSealed`` per batch and one
``RolloutPlanned`` (the plan is complete), the samples' lifecycle events, optional
``CaptureRequested`` and ``TeacherScored`` and finally ``RolloutReady``.

Idempotence rules (at-least-once delivery, crashed workers):
* a duplicate ``TaskFetched`` / ``BatchSealed`` (same id) is ignored;
* a ``TaskJoined`` (a group's sample whose task is stored once, in the group's first
  ``TaskFetched``) is folded as the ``TaskFetched`` it stands for, so ``SampleState.task`` is
  always the sample's whole task;
* ``SampleStarted`` raises the sample's current attempt, never lowers it;
* the first terminal event (``SampleCompleted`` or ``SampleAborted``) of a sample wins; any
  later terminal, whatever its attempt, is a duplicate and ignored;
* ``TeacherScored`` counts only for the attempt that produced the terminal trajectory;
* the first ``CaptureRequested`` and the first ``RolloutReady`` win;
* ``PromptStored`` keeps the first prompt of each key; a ``SampleCompleted`` that refers to
  one (``prompt_key``) is kept with its ``prompt_ids`` filled in from it, so every reader
  sees the trajectory whole, as if the prompt had been stored with the sample.

Counters kept by the fold, so that a follower can tell cheaply whether deciding is worth
it: ``n_terminal`` (samples with a terminal event) and ``n_scored`` (samples with their
``TeacherScored``).

Performance note: folding a 100k-sample rollout must stay linear, so the state is an
accumulator that ``evolve`` updates in place and returns. The fold owns it: take
``copy()`` before keeping a state that a later fold would extend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from engine.errors import RolloutError
from engine.events.base import Envelope
from engine.events.catalog import (
    BatchSealed,
    CaptureRequested,
    PolicyVersionPublished,
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

Terminal = SampleCompleted | SampleAborted


@dataclass(frozen=True, slots=True)
class SampleState:
    task: TaskFetched
    attempt: int = -1
    started: SampleStarted | None = None
    turns: tuple[TurnCompleted, ...] = ()
    terminal: Terminal | None = None
    teacher: TeacherScored | None = None

    @property
    def sample_id(self) -> str:
        return self.task.sample_id

    @property
    def done(self) -> bool:
        return self.terminal is not None

    @property
    def completed(self) -> SampleCompleted | None:
        return self.terminal if isinstance(self.terminal, SampleCompleted) else None

    @property
    def aborted(self) -> SampleAborted | None:
        return self.terminal if isinstance(self.terminal, SampleAborted) else None


@dataclass(slots=True)
class RolloutState:
    rollout_id: str | None = None
    request: RolloutRequested | None = None
    samples: dict[str, SampleState] = field(default_factory=dict)
    batches: dict[str, BatchSealed] = field(default_factory=dict)
    planned: RolloutPlanned | None = None
    ready: RolloutReady | None = None
    failed: RolloutFailed | None = None
    capture: CaptureRequested | None = None
    prompts: dict[str, PromptStored] = field(default_factory=dict)
    event_count: int = 0
    n_terminal: int = 0
    n_scored: int = 0
    # Per group index: its planned samples and how many are terminal; ``completed_groups``
    # lists groups in the order they became whole (every sample terminal), which is log
    # order -- the order a partial rollout takes its first ``n_prompts`` groups in.
    group_size: dict[int, int] = field(default_factory=dict)
    group_done: dict[int, int] = field(default_factory=dict)
    completed_groups: list[int] = field(default_factory=list)

    def copy(self) -> RolloutState:
        return replace(
            self,
            samples=dict(self.samples),
            batches=dict(self.batches),
            group_size=dict(self.group_size),
            group_done=dict(self.group_done),
            completed_groups=list(self.completed_groups),
            prompts=dict(self.prompts),
        )

    @property
    def n_samples(self) -> int:
        return len(self.samples)

    @property
    def n_done(self) -> int:
        return self.n_terminal

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
        return all(s.done for s in self.samples.values())

    def ordered(self) -> list[SampleState]:
        """Samples in task order (index), the order the trainer sees."""
        return sorted(self.samples.values(), key=lambda s: s.task.index)


class RolloutProjection:
    """Folds one rollout stream into a :class:`RolloutState`."""

    name = "rollout"

    def initial(self) -> RolloutState:
        return RolloutState()

    def evolve(self, state: RolloutState, env: Envelope) -> RolloutState:
        ev = env.event
        state.event_count += 1
        if isinstance(ev, TaskJoined):
            if ev.sample_id not in state.samples:
                ev = _joined(ev, state.samples.get(ev.same_as))
        if isinstance(ev, TaskFetched):
            if ev.sample_id not in state.samples:
                state.samples[ev.sample_id] = SampleState(task=ev)
                state.rollout_id = state.rollout_id or ev.rollout_id
                g = ev.group_index
                state.group_size[g] = state.group_size.get(g, 0) + 1
        elif isinstance(ev, SampleStarted):
            s = state.samples.get(ev.sample_id)
            if s is not None and not s.done and ev.attempt >= s.attempt:
                turns = s.turns if ev.attempt == s.attempt else ()  # a re-run starts afresh
                # The constructor, positionally: ``dataclasses.replace`` introspects the
                # fields on every call, and this runs once per event of the rollout.
                state.samples[ev.sample_id] = SampleState(
                    s.task, ev.attempt, ev, turns, s.terminal, s.teacher
                )
        elif isinstance(ev, TurnCompleted):
            s = state.samples.get(ev.sample_id)
            if s is not None and not s.done and ev.attempt == s.attempt:
                state.samples[ev.sample_id] = SampleState(
                    s.task, s.attempt, s.started, (*s.turns, ev), s.terminal, s.teacher
                )
        elif isinstance(ev, SampleCompleted | SampleAborted):
            s = state.samples.get(ev.sample_id)
            if s is not None and not s.done:
                if isinstance(ev, SampleCompleted) and ev.prompt_key:
                    ev = _with_prompt(ev, state.prompts.get(ev.prompt_key))
                turns = s.turns if ev.attempt == s.attempt else ()
                state.samples[ev.sample_id] = SampleState(
                    s.task, max(s.attempt, ev.attempt), s.started, turns, ev, s.teacher
                )
                state.n_terminal += 1
                g = s.task.group_index
                done = state.group_done[g] = state.group_done.get(g, 0) + 1
                if done == state.group_size.get(g, 0):
                    state.completed_groups.append(g)
        elif isinstance(ev, TeacherScored):
            s = state.samples.get(ev.sample_id)
            if (
                s is not None
                and s.completed is not None
                and s.completed.attempt == ev.attempt
                and s.teacher is None
            ):
                state.samples[ev.sample_id] = SampleState(
                    s.task, s.attempt, s.started, s.turns, s.terminal, ev
                )
                state.n_scored += 1
        elif isinstance(ev, PromptStored):
            state.prompts.setdefault(ev.prompt_key, ev)
        elif isinstance(ev, BatchSealed):
            state.batches.setdefault(ev.batch_id, ev)
        elif isinstance(ev, RolloutPlanned):
            if state.planned is None:
                state.planned = ev
        elif isinstance(ev, RolloutRequested):
            if state.request is None:
                state.request = ev
                state.rollout_id = ev.rollout_id
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


# ---------------------------------------------------------------- the control stream


@dataclass(slots=True)
class ControlState:
    """What the engine's actors need of ``rl:control`` besides requests (issue 12).

    ``published``: the highest ``PolicyVersionPublished.version`` (None before any);
    ``tails``: per rollout that became ready with a tail (an over-provisioned rollout), the
    tail's sample ids and what the request said to do with them (``abort`` / ``carry``),
    so a worker can abort the tail samples it still runs. Only the most recent
    ``keep_tails`` rollouts are kept (a worker runs recent rollouts only)."""

    published: int | None = None
    tails: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)

    def current_version(self, request: RolloutRequested | None) -> int | None:
        """The trainer's current version for ``request``: the highest published version,
        or the request's ``policy_version`` when higher (None: neither is known)."""
        versions = [v for v in (self.published,) if v is not None]
        if request is not None:
            versions.append(request.policy_version)
        return max(versions) if versions else None


class ControlProjection:
    """Folds ``rl:control`` into a :class:`ControlState` (policy versions, ready tails)."""

    name = "control"

    def __init__(self, keep_tails: int = 256) -> None:
        self._keep = keep_tails

    def initial(self) -> ControlState:
        return ControlState()

    def evolve(self, state: ControlState, env: Envelope) -> ControlState:
        ev = env.event
        if isinstance(ev, PolicyVersionPublished):
            if state.published is None or ev.version > state.published:
                state.published = ev.version
        elif isinstance(ev, RolloutReady) and ev.tail_sample_ids:
            if ev.rollout_id not in state.tails:
                mode = "carry" if ev.tail_carried else "abort"
                state.tails[ev.rollout_id] = (mode, frozenset(ev.tail_sample_ids))
                while len(state.tails) > self._keep:
                    del state.tails[next(iter(state.tails))]
        return state


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
def _with_prompt(ev: SampleCompleted, stored: PromptStored | None) -> SampleCompleted:
    """``ev`` with the prompt tokens it refers to filled in (as validated in the
    ``PromptStored``). A reference to a prompt the stream does not hold cannot be resolved:
    it is an error in the writer, named here rather than turned into a wrong trajectory."""
    if stored is None:
        raise RolloutError(
            f"SampleCompleted {ev.sample_id} (rollout {ev.rollout_id}) refers to prompt "
            f"{ev.prompt_key!r}, which no earlier PromptStored of the stream holds"
        )
    return ev.model_copy(update={"prompt_ids": stored.prompt_ids})


def _joined(ev: TaskJoined, first: SampleState | None) -> TaskFetched:
    """The ``TaskFetched`` a ``TaskJoined`` stands for. A reference to a sample the stream
    does not hold (earlier) is the writer's error, named here rather than guessed at."""
    if first is None:
        raise RolloutError(
            f"TaskJoined {ev.sample_id} (rollout {ev.rollout_id}) refers to sample "
            f"{ev.same_as!r}, whose TaskFetched no earlier entry of the stream holds"
        )
    return ev.task(first.task)
