"""Human-readable views of the log: one line per event (``rollout tail``) and a rollout's
progress (``rollout status``, with what a stalled rollout waits for).

An event line reads ``time  stream  Type  rollout=.. sample=.. <details>  cause=..`` where
the time is the stream id's millisecond timestamp (UTC), details are the few fields that
say what happened (attempt, reward, abort class, batch, tokens, ...) and ``cause`` is the
``stream@id`` of the event that caused it, so any line can be traced back.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import DecodeError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    BatchAdmitted,
    BatchSealed,
    CaptureRequested,
    DeadLetter,
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
    TokenAcquired,
    TokenReleased,
    TurnCompleted,
)
from engine.events.catalog.diagnostics import RolloutStalled
from engine.events.codec import decode
from engine.events.ids import EMPTY_ID, id_ms, parse_id
from engine.events.log import EventLog
from engine.projections.rollout import RolloutState

__all__ = ["BatchProgress", "describe", "last_stall", "progress", "status_lines", "tail"]


def _time(entry_id: str) -> str:
    ms = id_ms(entry_id)
    stamp = dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)
    return stamp.strftime("%H:%M:%S.") + f"{ms % 1000:03d}"


def _details(ev: Event) -> list[str]:
    if isinstance(ev, RolloutRequested):
        return [
            f"iteration={ev.iteration}",
            f"kind={ev.kind.value}",
            f"prompts={ev.n_prompts}x{ev.n_samples_per_prompt or 1}",
            f"algorithm={ev.algorithm}",
        ]
    if isinstance(ev, TaskFetched):
        return [f"dataset={ev.dataset}", f"group={ev.group_index}", f"type={ev.task_type}"]
    if isinstance(ev, TaskJoined):
        return [f"group={ev.group_index}", f"same_as={ev.same_as}"]
    if isinstance(ev, BatchSealed | BatchAdmitted):
        extra = [f"tokens={len(ev.token_ids)}"] if isinstance(ev, BatchAdmitted) else []
        return [f"batch={ev.batch_id}", f"samples={len(ev.sample_ids)}", *extra]
    if isinstance(ev, RolloutPlanned):
        return [f"samples={ev.n_samples}", f"batches={ev.n_batches}"]
    if isinstance(ev, SampleStarted):
        return [f"attempt={ev.attempt}", f"batch={ev.batch_id}", f"worker={ev.worker}",
                f"node={ev.node}"]
    if isinstance(ev, TurnCompleted):
        return [f"attempt={ev.attempt}", f"turn={ev.turn}", f"node={ev.node}",
                f"tokens={ev.prompt_tokens}+{ev.response_tokens}"]
    if isinstance(ev, SampleCompleted):
        return [f"attempt={ev.attempt}", f"reward={ev.reward:g}",
                f"reason={ev.termination_reason}", f"response={len(ev.response_ids)}"]
    if isinstance(ev, SampleAborted):
        out = [f"attempt={ev.attempt}", f"class={ev.abort_class.value}", f"phase={ev.phase}"]
        if ev.agent_reason:
            out.append(f"agent_reason={ev.agent_reason}")
        return [*out, f"error={ev.error[:120]!r}"]
    if isinstance(ev, TeacherScored):
        return [f"attempt={ev.attempt}", f"tokens={len(ev.teacher_logprobs)}", f"k={ev.top_k}"]
    if isinstance(ev, TokenAcquired):
        return [f"batch={ev.batch_id}", f"tokens={len(ev.tokens)}"]
    if isinstance(ev, TokenReleased):
        tokens = "all" if ev.token_ids is None else str(len(ev.token_ids))
        return [f"batch={ev.batch_id}", f"tokens={tokens}", f"reason={ev.reason}"]
    if isinstance(ev, CaptureRequested):
        return [f"samples={len(ev.sample_ids)}", f"top_k={ev.top_k}"]
    if isinstance(ev, RolloutReady):
        return [f"kept={len(ev.sample_ids)}", f"dropped={len(ev.dropped_sample_ids)}",
                f"completed={ev.n_completed}", f"aborted={ev.n_aborted}"] + (
            ["dummy"] if ev.dummy else []
        )
    if isinstance(ev, RolloutFailed):
        return [f"reason={ev.reason!r}"]
    if isinstance(ev, RolloutStalled):
        return [f"idle={ev.idle_s:.0f}s", f"waiting_for={'; '.join(ev.waiting_for)!r}"]
    if isinstance(ev, DeadLetter):
        return [f"source={ev.source_stream}@{ev.source_id}", f"error={ev.error[:120]!r}"]
    return []


def describe(env: Envelope) -> str:
    """One readable line for an event (see the module docstring)."""
    ev = env.event
    parts = [_time(env.id), env.stream, ev.type]
    rollout = getattr(ev, "rollout_id", None)
    if rollout:
        parts.append(f"rollout={rollout}")
    sample = getattr(ev, "sample_id", None)
    if sample:
        parts.append(f"sample={sample}")
    parts.extend(_details(ev))
    if ev.producer:
        parts.append(f"by={ev.producer}")
    if ev.causation:
        parts.append(f"cause={ev.causation}")
    return "  ".join(p for p in parts if not p.endswith(("=", "=None")))


async def tail(
    log: EventLog,
    streams: Sequence[str],
    *,
    emit: Callable[[str], None],
    rollout_id: str | None = None,
    from_start: bool = False,
    count: int | None = None,
    block_ms: int | None = None,
    page: int = 500,
) -> int:
    """Print events of ``streams`` as they arrive (only ``rollout_id``'s when given), with
    blocking reads; returns after ``count`` lines (never when ``count`` is None).

    Lines come in time order across streams (ids of one Redis server share its clock; within
    one millisecond, entries of different streams follow stream-name order). A read
    returns up to ``page`` entries per stream; an entry is held back while a stream that
    filled its page may still hold an earlier one, so a backlog merges exactly.
    A viewer only reads: an entry that does not decode is shown as such, not dead-lettered.
    """
    positions = {s: EMPTY_ID if from_start else await log.last_id(s) for s in streams}
    block = log.block_ms if block_ms is None else block_ms
    held: list[tuple[tuple[int, int], str, str, bytes]] = []
    printed = 0
    while count is None or printed < count:
        entries = await log.tail_raw(positions, block_ms=block, count=page)
        per_stream: dict[str, int] = {}
        for stream, entry_id, raw in entries:
            positions[stream] = entry_id
            per_stream[stream] = per_stream.get(stream, 0) + 1
            held.append((parse_id(entry_id), stream, entry_id, raw))
        full = [parse_id(positions[s]) for s, n in per_stream.items() if n >= page]
        horizon = min(full) if full else None
        held.sort(key=lambda item: (item[0], item[1]))
        ready = [h for h in held if horizon is None or h[0] <= horizon]
        held = held[len(ready):]
        for _key, stream, entry_id, raw in ready:
            line = _line(stream, entry_id, raw, rollout_id)
            if line is None:
                continue
            emit(line)
            printed += 1
            if count is not None and printed >= count:
                return printed
    return printed


def _line(stream: str, entry_id: str, raw: bytes, rollout_id: str | None) -> str | None:
    try:
        env = Envelope(stream, entry_id, decode(raw))
    except DecodeError as exc:
        return None if rollout_id is not None else (
            f"{_time(entry_id)}  {stream}  <undecodable {entry_id}: {exc}>"
        )
    if rollout_id is not None and getattr(env.event, "rollout_id", None) != rollout_id:
        return None
    return describe(env)


@dataclass(frozen=True, slots=True)
class BatchProgress:
    batch_id: str
    evaluator_id: str
    planned: int
    started: int
    completed: int
    aborted: int

    @property
    def done(self) -> int:
        return self.completed + self.aborted


def progress(state: RolloutState) -> list[BatchProgress]:
    """Per sealed batch: samples planned, started, completed and aborted."""
    out: list[BatchProgress] = []
    for batch in sorted(state.batches.values(), key=lambda b: b.seq):
        samples = [state.samples[s] for s in batch.sample_ids if s in state.samples]
        out.append(
            BatchProgress(
                batch_id=batch.batch_id,
                evaluator_id=batch.evaluator_id,
                planned=len(batch.sample_ids),
                started=sum(1 for s in samples if s.started or s.done),
                completed=sum(1 for s in samples if s.completed),
                aborted=sum(1 for s in samples if s.aborted),
            )
        )
    return out


def last_stall(envelopes: Sequence[Envelope]) -> RolloutStalled | None:
    """The stream's last entry when it is a ``RolloutStalled`` (the rollout has not moved
    since it was reported), else None."""
    last = envelopes[-1].event if envelopes else None
    return last if isinstance(last, RolloutStalled) else None


def status_lines(state: RolloutState, stalled: RolloutStalled | None = None) -> list[str]:
    """A rollout's progress: a header, the totals, what it waits for when ``stalled`` (and
    still undecided), and one line per batch."""
    batches = progress(state)
    planned = state.planned.n_samples if state.planned is not None else None
    if state.ready is not None:
        verdict = (f"READY: {len(state.ready.sample_ids)} kept, "
                   f"{len(state.ready.dropped_sample_ids)} dropped"
                   + (" (dummy)" if state.ready.dummy else "")
                   + _partial_and_stale(state.ready))
    elif state.failed is not None:
        verdict = f"FAILED: {state.failed.reason}"
    elif state.planned is None:
        verdict = "planning"
    else:
        verdict = "running"
    lines = [
        f"rollout {state.rollout_id}: {verdict}",
        _totals(
            planned,
            len(state.samples),
            sum(1 for s in state.samples.values() if s.started or s.done),
            sum(1 for s in state.samples.values() if s.completed),
            sum(1 for s in state.samples.values() if s.aborted),
        ),
    ]
    if stalled is not None and not state.decided:
        lines.append(f"stalled: no progress for {stalled.idle_s:.0f} s; waiting for:")
        lines.extend(f"  - {wait}" for wait in stalled.waiting_for)
    lines.extend(
        f"  {b.batch_id:<28} {b.evaluator_id:<14} planned {b.planned:>5}  started "
        f"{b.started:>5}  completed {b.completed:>5}  aborted {b.aborted:>5}"
        for b in batches
    )
    return lines


def _partial_and_stale(ready: RolloutReady) -> str:
    """What the staleness bound excluded and a partial rollout left out."""
    out = ""
    if ready.trainer_version is not None:
        out += (f", {len(ready.stale_sample_ids)} stale ({ready.stale_tokens} tokens; trainer "
                f"at v{ready.trainer_version})")
    if ready.tail_sample_ids:
        what = "carried" if ready.tail_carried else "aborted"
        out += f", tail {len(ready.tail_sample_ids)} {what}"
    return out


def _totals(planned: int | None, fetched: int, started: int, completed: int, aborted: int) -> str:
    plan = "?" if planned is None else str(planned)
    return (
        f"samples: planned {plan} (fetched {fetched}), started {started}, "
        f"completed {completed}, aborted {aborted}, done {completed + aborted}"
    )
