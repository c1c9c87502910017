"""Whole samples from the fold's records: which entries to read back, and reading them.

The fold (:mod:`engine.projections.rollout`) keeps, per sample, the entry ids a whole sample
is built from. A :class:`Rollout` is the fold with those entries read back by id
(:func:`wanted` names them, :func:`ranges` groups them into few range reads; the I/O is
``engine.runtime.readback``'s). Everything that needs a sample's events goes through it.

An entry that is not the one the fold recorded there (missing, of another type or sample: the
stream changed between the fold and the read) is a ``RolloutError`` naming it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from engine.errors import RolloutError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    PromptStored,
    SampleAborted,
    SampleCompleted,
    TaskFetched,
    TaskJoined,
    TeacherScored,
    TurnCompleted,
)
from engine.events.ids import parse_id
from engine.projections.rollout import (
    RolloutState,
    SampleRecord,
    joined_task,
    with_prompt,
)

__all__ = ["Rollout", "in_memory", "ranges", "wanted"]


@dataclass(frozen=True, slots=True)
class Rollout:
    """A folded rollout stream and the entries read back for (some of) its samples, by id."""

    state: RolloutState
    entries: Mapping[str, Event]

    def record(self, sample_id: str) -> SampleRecord | None:
        return self.state.samples.get(sample_id)

    def task(self, r: SampleRecord) -> TaskFetched:
        """The sample's whole task (a joined one built from its group's first)."""
        entry = self._entry(r.task_at, (TaskFetched, TaskJoined), r.sample_id)
        if isinstance(entry, TaskFetched):
            return entry
        assert isinstance(entry, TaskJoined)
        root = self._entry(r.root_at, (TaskFetched,), None)
        assert isinstance(root, TaskFetched)
        return joined_task(entry, root)

    def terminal(self, r: SampleRecord) -> SampleCompleted | SampleAborted | None:
        """The sample's first terminal event, a trajectory's stored prompt filled in."""
        if r.terminal_at is None:
            return None
        ev = self._entry(r.terminal_at, (SampleCompleted, SampleAborted), r.sample_id)
        if r.prompt_at is not None:
            assert isinstance(ev, SampleCompleted)
            stored = self._entry(r.prompt_at, (PromptStored,), None)
            assert isinstance(stored, PromptStored)
            return with_prompt(ev, stored)
        assert isinstance(ev, SampleCompleted | SampleAborted)
        return ev

    def completed(self, r: SampleRecord) -> SampleCompleted:
        done = self.terminal(r)
        assert isinstance(done, SampleCompleted), r.sample_id
        return done

    def teacher(self, r: SampleRecord) -> TeacherScored | None:
        if r.teacher_at is None:
            return None
        ev = self._entry(r.teacher_at, (TeacherScored,), r.sample_id)
        assert isinstance(ev, TeacherScored)
        return ev

    def turns(self, r: SampleRecord) -> list[TurnCompleted]:
        """The turns of the attempt that ended the sample (of its current one, if running)."""
        out = []
        for at in r.turn_at:
            ev = self._entry(at, (TurnCompleted,), r.sample_id)
            assert isinstance(ev, TurnCompleted)
            out.append(ev)
        return out

    def _entry(self, at: str, kinds: tuple[type[Event], ...], sample_id: str | None) -> Event:
        ev = self.entries.get(at)
        if (
            ev is None
            or not isinstance(ev, kinds)
            or (sample_id is not None and getattr(ev, "sample_id", None) != sample_id)
        ):
            raise RolloutError(
                f"rollout {self.state.rollout_id}: entry {at} of the stream is not the "
                f"{'/'.join(k.__name__ for k in kinds)} the fold read there (the stream "
                f"changed while it was read)"
            )
        return ev


def wanted(
    state: RolloutState, sample_ids: Iterable[str], *, turns: bool = False
) -> list[str]:
    """The entry ids the samples of ``sample_ids`` are built from (and, with ``turns``,
    their turns), in stream order; ids the fold does not know add none."""
    out: set[str] = set()
    samples = state.samples
    for sample_id in sample_ids:
        r = samples.get(sample_id)
        if r is None:
            continue
        out.add(r.task_at)
        out.add(r.root_at)
        for at in (r.terminal_at, r.prompt_at, r.teacher_at):
            if at is not None:
                out.add(at)
        if turns:
            out.update(r.turn_at)
    return sorted(out, key=parse_id)


def ranges(state: RolloutState, ids: Sequence[str], *, gap: int = 0) -> list[tuple[str, str]]:
    """Inclusive ``(first, last)`` id ranges holding ``ids`` (in stream order). An id at most
    ``gap`` marks past the one before shares its range: reading a few entries more beats
    another range read."""
    marks = state.marks
    out: list[tuple[str, str]] = []
    first = last = ""
    last_mark = 0
    for at in ids:
        mark = bisect_right(marks, parse_id(at))
        if first and mark - last_mark <= gap:
            last, last_mark = at, mark
            continue
        if first:
            out.append((first, last))
        first = last = at
        last_mark = mark
    if first:
        out.append((first, last))
    return out


def in_memory(state: RolloutState, envelopes: Iterable[Envelope]) -> Rollout:
    """``state`` with every entry of ``envelopes`` (a whole stream in memory: a replay)."""
    return Rollout(state, {env.id: env.event for env in envelopes})
