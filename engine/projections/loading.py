"""Loading a ready rollout's samples from its stream's raw entries: fast, and in chunks.

The trainer's ``load`` / ``iter_load`` (``engine.client``) need far less of a rollout
stream than :class:`~engine.projections.rollout.RolloutProjection` folds: a sample's
``Sample`` is made of its task, its first terminal event, the ``TeacherScored`` of that
terminal's attempt and the prompt it refers to, plus the request (its lane) and the first
``RolloutReady`` (which samples, in which order). ``SampleStarted``, ``TurnCompleted``,
``BatchSealed`` and the rest change none of these, so these folds skip them without decoding
them: an entry in the canonical form names its type in its first bytes (:func:`type_name`).
Every entry they do take is decoded by ``engine.events.codec.decode``, the log's own reader,
and one that does not decode is skipped, as the log's readers skip it. The rules of
:class:`RolloutProjection` that decide those parts are kept exactly: the first ``TaskFetched``
of an id wins, a ``TaskJoined`` stands for its group's first task (one whose ``same_as`` no
earlier entry holds is an error), the first terminal of a known sample wins whatever its
attempt, the first ``TeacherScored`` of the terminal's attempt of a completed sample counts,
a ``SampleCompleted`` refers to the first ``PromptStored`` of its key (which must come
earlier), the first request and the first ready win. So the samples built from them are
those ``trainer_samples`` builds from the full fold, byte for byte
(``tests/projections/test_loading.py`` holds the two to that on random streams).

Two folds:

* :class:`LoadFold` keeps those events of every sample and gives a :class:`RolloutState`
  holding exactly them (``load``: one pass, then ``trainer_samples``).
* :class:`IndexFold` keeps, per sample, only *where* they are: the ordinals (positions in
  the stream) of its task entry, its group's first task, its terminal, its teacher scoring
  and its prompt, in flat integer arrays (about 50 bytes a sample beside its id), plus one
  entry id every :data:`MARK_EVERY` entries. ``iter_load`` folds it in a first pass, then
  per chunk of ``RolloutReady.sample_ids`` reads back just the entries it names
  (:meth:`IndexFold.ranges`: a few XRANGEs, one round trip) and builds that chunk
  (:meth:`IndexFold.chunk_state`), so it never holds more than one chunk's events.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping, Sequence

from engine.errors import DecodeError, RolloutError
from engine.events.base import Event
from engine.events.catalog import (
    PromptStored,
    RolloutReady,
    RolloutRequested,
    SampleAborted,
    SampleCompleted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
)
from engine.events.codec import decode
from engine.projections.rollout import RolloutState, SampleState, _joined, _with_prompt

__all__ = ["MARK_EVERY", "IndexFold", "LoadFold", "type_name"]

MARK_EVERY = 32
""":class:`IndexFold` keeps the entry id of every ``MARK_EVERY``-th entry: an entry is read
back by its ordinal from the mark before it."""

_WANTED = frozenset(
    {
        b"TaskFetched",
        b"TaskJoined",
        b"SampleCompleted",
        b"SampleAborted",
        b"TeacherScored",
        b"PromptStored",
        b"RolloutRequested",
        b"RolloutReady",
    }
)
_TYPE_KEY = b"\xa4type"  # msgpack fixstr "type"


def type_name(raw: bytes) -> bytes | None:
    """The event type an entry names, when it is in the canonical form ``codec.encode``
    writes (a map whose first key is ``type``, a short string); None otherwise (the entry
    must then be decoded to tell)."""
    head = raw[0] if raw else 0
    if 0x80 <= head <= 0x8F:  # fixmap
        at = 1
    elif head == 0xDE:  # map 16
        at = 3
    else:
        return None
    if not raw.startswith(_TYPE_KEY, at):
        return None
    size = raw[at + 5] - 0xA0 if len(raw) > at + 5 else -1
    if not 0 <= size < 32:  # a fixstr
        return None
    return raw[at + 6 : at + 6 + size]


def _decoded(raw: bytes) -> Event | None:
    """The entry's event, or None: not one loading needs, or not decodable (skipped, as
    every reader of the log skips it; its stream's owner dead-letters it)."""
    name = type_name(raw)
    if name is not None and name not in _WANTED:
        return None
    try:
        return decode(raw)
    except DecodeError:
        return None


class _Fold:
    """The rules both folds share (see the module docstring); subclasses keep what they
    keep of each sample."""

    def __init__(self) -> None:
        self.rollout_id: str | None = None
        self.request: RolloutRequested | None = None
        self.ready: RolloutReady | None = None
        self.n_entries = 0

    def feed(self, entries: Iterable[tuple[str, bytes]]) -> None:
        """Fold the next entries of the stream, in order."""
        for entry_id, raw in entries:
            at = self.n_entries
            self.n_entries = at + 1
            self._mark(at, entry_id)
            ev = _decoded(raw)
            if ev is None:
                continue
            if isinstance(ev, SampleCompleted | SampleAborted):
                self._terminal(at, ev)
            elif isinstance(ev, TaskJoined):
                self._joined(at, ev)
            elif isinstance(ev, TaskFetched):
                self._task(at, ev)
            elif isinstance(ev, TeacherScored):
                self._teacher(at, ev)
            elif isinstance(ev, PromptStored):
                self._prompt(at, ev)
            elif isinstance(ev, RolloutRequested):
                if self.request is None:
                    self.request = ev
                    self.rollout_id = ev.rollout_id
            elif isinstance(ev, RolloutReady):
                if self.ready is None:
                    self.ready = ev

    def _mark(self, at: int, entry_id: str) -> None:
        pass

    def _task(self, at: int, ev: TaskFetched) -> None:
        raise NotImplementedError

    def _joined(self, at: int, ev: TaskJoined) -> None:
        raise NotImplementedError

    def _terminal(self, at: int, ev: SampleCompleted | SampleAborted) -> None:
        raise NotImplementedError

    def _teacher(self, at: int, ev: TeacherScored) -> None:
        raise NotImplementedError

    def _prompt(self, at: int, ev: PromptStored) -> None:
        raise NotImplementedError


class LoadFold(_Fold):
    """Every sample's task, terminal and teacher scoring, kept as events (``load``)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: dict[str, SampleState] = {}
        self.prompts: dict[str, PromptStored] = {}

    def state(self) -> RolloutState:
        """A :class:`RolloutState` with what ``trainer_samples`` reads (the samples' tasks,
        terminals and teacher scorings, the request, the ready event); its other fields
        (attempts, turns, batches, counters) are not folded here."""
        return RolloutState(
            rollout_id=self.rollout_id,
            request=self.request,
            samples=self.samples,
            ready=self.ready,
            prompts=self.prompts,
        )

    def _task(self, at: int, ev: TaskFetched) -> None:
        if ev.sample_id not in self.samples:
            self.samples[ev.sample_id] = SampleState(ev)
            self.rollout_id = self.rollout_id or ev.rollout_id

    def _joined(self, at: int, ev: TaskJoined) -> None:
        if ev.sample_id not in self.samples:
            self._task(at, _joined(ev, self.samples.get(ev.same_as)))

    def _terminal(self, at: int, ev: SampleCompleted | SampleAborted) -> None:
        s = self.samples.get(ev.sample_id)
        if s is not None and s.terminal is None:
            if isinstance(ev, SampleCompleted) and ev.prompt_key:
                ev = _with_prompt(ev, self.prompts.get(ev.prompt_key))
            self.samples[ev.sample_id] = SampleState(s.task, terminal=ev)

    def _teacher(self, at: int, ev: TeacherScored) -> None:
        s = self.samples.get(ev.sample_id)
        if (
            s is not None
            and isinstance(s.terminal, SampleCompleted)
            and s.terminal.attempt == ev.attempt
            and s.teacher is None
        ):
            self.samples[ev.sample_id] = SampleState(s.task, terminal=s.terminal, teacher=ev)

    def _prompt(self, at: int, ev: PromptStored) -> None:
        self.prompts.setdefault(ev.prompt_key, ev)


_NONE = -1
_COMPLETED, _ABORTED = 1, 2


class IndexFold(_Fold):
    """Where each sample's events are (ordinals), not the events (``iter_load``'s first
    pass); see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.row: dict[str, int] = {}
        self.task_at = array("q")
        self.root_at = array("q")  # the group's first TaskFetched (the task's own if whole)
        self.terminal_at = array("q")
        self.terminal_kind = array("b")
        self.attempt = array("q")  # the terminal's
        self.prompt_at = array("q")
        self.teacher_at = array("q")
        self.prompts: dict[str, int] = {}
        self.marks: list[str] = []

    def _mark(self, at: int, entry_id: str) -> None:
        if at % MARK_EVERY == 0:
            self.marks.append(entry_id)

    def _add(self, sample_id: str, task_at: int, root_at: int) -> None:
        self.row[sample_id] = len(self.task_at)
        self.task_at.append(task_at)
        self.root_at.append(root_at)
        self.terminal_at.append(_NONE)
        self.terminal_kind.append(0)
        self.attempt.append(0)
        self.prompt_at.append(_NONE)
        self.teacher_at.append(_NONE)

    def _task(self, at: int, ev: TaskFetched) -> None:
        if ev.sample_id not in self.row:
            self._add(ev.sample_id, at, at)
            self.rollout_id = self.rollout_id or ev.rollout_id

    def _joined(self, at: int, ev: TaskJoined) -> None:
        if ev.sample_id in self.row:
            return
        first = self.row.get(ev.same_as)
        if first is None:
            _joined(ev, None)  # raises, naming the reference
            return
        self._add(ev.sample_id, at, self.root_at[first])

    def _terminal(self, at: int, ev: SampleCompleted | SampleAborted) -> None:
        i = self.row.get(ev.sample_id)
        if i is None or self.terminal_kind[i]:
            return
        if isinstance(ev, SampleCompleted):
            if ev.prompt_key:
                stored = self.prompts.get(ev.prompt_key)
                if stored is None:
                    _with_prompt(ev, None)  # raises, naming the reference
                    return
                self.prompt_at[i] = stored
            self.terminal_kind[i] = _COMPLETED
        else:
            self.terminal_kind[i] = _ABORTED
        self.terminal_at[i] = at
        self.attempt[i] = ev.attempt

    def _teacher(self, at: int, ev: TeacherScored) -> None:
        i = self.row.get(ev.sample_id)
        if (
            i is not None
            and self.terminal_kind[i] == _COMPLETED
            and self.attempt[i] == ev.attempt
            and self.teacher_at[i] == _NONE
        ):
            self.teacher_at[i] = at

    def _prompt(self, at: int, ev: PromptStored) -> None:
        self.prompts.setdefault(ev.prompt_key, at)

    def has_terminal(self, sample_id: str) -> bool:
        """Whether the sample is known and has a terminal event."""
        i = self.row.get(sample_id)
        return i is not None and self.terminal_kind[i] != 0

    def completed(self, sample_id: str) -> bool:
        """Whether the sample's first terminal event is a ``SampleCompleted``."""
        i = self.row.get(sample_id)
        return i is not None and self.terminal_kind[i] == _COMPLETED

    # ------------------------------------------------------------ the second pass

    def wanted(self, sample_ids: Sequence[str]) -> list[int]:
        """The ordinals of the entries the samples of ``sample_ids`` are built from, sorted
        (ids the fold does not know, or that have no terminal, add none: building names
        them)."""
        out: set[int] = set()
        for sample_id in sample_ids:
            i = self.row.get(sample_id)
            if i is None:
                continue
            out.add(self.task_at[i])
            out.add(self.root_at[i])
            for at in (self.terminal_at[i], self.prompt_at[i], self.teacher_at[i]):
                if at != _NONE:
                    out.add(at)
        return sorted(out)

    def ranges(self, wanted: Sequence[int], gap: int = 64) -> list[tuple[str, int, int]]:
        """XRANGEs that read back the entries at ``wanted`` (sorted ordinals): for each,
        ``(start id, count, ordinal of its first entry)``. Ordinals closer than ``gap`` share
        a range (reading a few entries more beats another range)."""
        out: list[tuple[str, int, int]] = []
        first = last = -1
        for at in wanted:
            if first >= 0 and at - last <= gap:
                last = at
                continue
            if first >= 0:
                out.append(self._range(first, last))
            first = last = at
        if first >= 0:
            out.append(self._range(first, last))
        return out

    def _range(self, first: int, last: int) -> tuple[str, int, int]:
        mark = first // MARK_EVERY
        start = mark * MARK_EVERY
        return self.marks[mark], last - start + 1, start

    def chunk_state(
        self, sample_ids: Sequence[str], events: Mapping[int, Event]
    ) -> RolloutState:
        """The :class:`RolloutState` of the samples of ``sample_ids`` (as :meth:`LoadFold.state`
        gives them), from ``events``: the entries :meth:`wanted` named, decoded, by ordinal.
        An entry that is not the one the first pass saw there (the stream changed between
        the passes) is an error."""
        samples: dict[str, SampleState] = {}
        for sample_id in sample_ids:
            i = self.row.get(sample_id)
            if i is None or sample_id in samples:
                continue
            task_ev = self._event(events, self.task_at[i], sample_id, TaskFetched | TaskJoined)
            if isinstance(task_ev, TaskJoined):
                root = self._event(events, self.root_at[i], None, TaskFetched)
                assert isinstance(root, TaskFetched)
                task = task_ev.task(root)
            else:
                assert isinstance(task_ev, TaskFetched)
                task = task_ev
            state = SampleState(task)
            if self.terminal_kind[i]:
                terminal = self._event(
                    events, self.terminal_at[i], sample_id, SampleCompleted | SampleAborted
                )
                assert isinstance(terminal, SampleCompleted | SampleAborted)
                if isinstance(terminal, SampleCompleted) and terminal.prompt_key:
                    stored = self._event(events, self.prompt_at[i], None, PromptStored)
                    assert isinstance(stored, PromptStored)
                    terminal = _with_prompt(terminal, stored)
                teacher: TeacherScored | None = None
                if self.teacher_at[i] != _NONE:
                    scored = self._event(events, self.teacher_at[i], sample_id, TeacherScored)
                    assert isinstance(scored, TeacherScored)
                    teacher = scored
                state = SampleState(task, terminal=terminal, teacher=teacher)
            samples[sample_id] = state
        return RolloutState(
            rollout_id=self.rollout_id, request=self.request, samples=samples, ready=self.ready
        )

    def _event(
        self, events: Mapping[int, Event], at: int, sample_id: str | None, kind: object
    ) -> Event:
        ev = events.get(at)
        if (
            ev is None
            or not isinstance(ev, kind)  # type: ignore[arg-type]
            or (sample_id is not None and getattr(ev, "sample_id", None) != sample_id)
        ):
            raise RolloutError(
                f"rollout {self.rollout_id}: entry {at} of the stream is not the one read "
                f"before (the stream changed while it was loaded)"
            )
        return ev

    def nbytes(self) -> int:
        """The arrays' size (the per-sample index, without the id dictionary)."""
        arrays = (
            self.task_at, self.root_at, self.terminal_at, self.terminal_kind, self.attempt,
            self.prompt_at, self.teacher_at,
        )
        return sum(a.itemsize * len(a) for a in arrays)
