"""What ``rollout view`` reads: every rollout stream on the log, each folded incrementally with
the rollout projection, plus what the timeline needs that the fold does not keep (each
attempt's start and the entry ids of every attempt's events), and ``rl:control`` / ``rl:pool``
for the weight-sync bands, the model servers' states (as the workers reported them) and the
pool's occupancy.

The log is only read: an entry that does not decode is skipped, never dead-lettered. Each
refresh reads what was appended since the last one, so a page of a running rollout costs the
new tail. An archive (``rollout view --from FILE``) is served from an in-memory log holding its
entries at their recorded ids, through the same code.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from engine.errors import DecodeError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    PolicyVersionActivated,
    QuiesceCompleted,
    QuiesceRequested,
    SampleAborted,
    SampleCompleted,
    SampleStarted,
    SampleVerified,
    TokenAcquired,
    TokenReleased,
    TurnCompleted,
    WeightSyncFailed,
)
from engine.events.catalog.diagnostics import RolloutStalled
from engine.events.catalog.servers import ServerDown, ServerStale, ServerUp
from engine.events.codec import decode
from engine.events.fastpath import checked
from engine.events.ids import id_ms, parse_id
from engine.events.log import EventLog
from engine.events.log_base import FIELD, gc_paused
from engine.events.memory_log import MemoryEventLog
from engine.events.names import StreamNames
from engine.projections.readback import Rollout
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.archive import Archive
from engine.runtime.readback import read_back, read_entries

__all__ = ["Attempt", "Band", "RolloutData", "ViewData", "archive_log"]

_ATTEMPT_EVENTS = (SampleStarted, TurnCompleted, SampleAborted, SampleCompleted, SampleVerified)


@dataclass(slots=True)
class Attempt:
    """One start of a sample: when, where, and its ``SampleStarted`` entry id."""

    attempt: int
    start_ms: int
    node: str
    worker: str
    at: str


@dataclass(frozen=True, slots=True)
class Band:
    """A span of ``rl:control`` time the timeline shades: a quiesce (``kind`` ``quiesce``,
    ``end_ms`` its completion; None: still open) or a version activation or a failed sync
    (``end_ms`` == ``start_ms``)."""

    kind: str
    start_ms: int
    end_ms: int | None
    label: str


@dataclass
class RolloutData:
    """One rollout stream folded so far, with its attempts and the ids of their events."""

    rollout_id: str
    stream: str
    state: RolloutState = field(default_factory=RolloutState)
    position: str | None = None
    first_ms: int | None = None
    last_ms: int | None = None
    last_event: Event | None = None
    starts: dict[str, list[Attempt]] = field(default_factory=dict)
    events_of: dict[str, list[str]] = field(default_factory=dict)  # every attempt's entries
    projection: RolloutProjection = field(default_factory=RolloutProjection)

    def feed(self, raw: list[tuple[str, bytes]]) -> None:
        """Fold the next raw entries: the events a stream is mostly made of from their
        checked fields (``fastpath.checked``, no event built), the rest decoded."""
        projection, state = self.projection, self.state
        last: Event | None = None
        for entry_id, data in raw:
            found = checked(data)
            if found is not None and projection.fold_checked(state, entry_id, *found):
                cls, fields = found
                last = None
            else:
                try:
                    last = decode(data)
                except DecodeError:
                    continue
                projection.evolve(state, Envelope(self.stream, entry_id, last))
                cls, fields = type(last), last
            if cls in _ATTEMPT_EVENTS:
                self.events_of.setdefault(fields.sample_id, []).append(entry_id)
                if cls is SampleStarted:
                    self.starts.setdefault(fields.sample_id, []).append(Attempt(
                        fields.attempt, id_ms(entry_id), fields.node, fields.worker, entry_id
                    ))
        if raw:
            if self.first_ms is None:
                self.first_ms = id_ms(raw[0][0])
            self.last_ms = id_ms(raw[-1][0])
            self.last_event = last

    @property
    def stalled(self) -> RolloutStalled | None:
        """The stream's last entry when it is a ``RolloutStalled`` (not moved since)."""
        ev = self.last_event
        return ev if isinstance(ev, RolloutStalled) else None


@dataclass
class _Pool:
    """``rl:pool`` as the timeline needs it: tokens held per rollout over time."""

    position: str | None = None
    held: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # (rollout, batch)
    total: dict[str, int] = field(default_factory=dict)  # tokens held per rollout
    series: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # ms, tokens held
    events: dict[str, list[str]] = field(default_factory=dict)  # the rollout's pool entries

    def feed(self, env: Envelope) -> None:
        ev = env.event
        if not isinstance(ev, TokenAcquired | TokenReleased):
            return
        rid = ev.rollout_id
        tokens = self.held.setdefault((rid, ev.batch_id), set())
        before = len(tokens)
        if isinstance(ev, TokenAcquired):
            tokens.update(t.token_id for t in ev.tokens)
        elif ev.token_ids is None:
            tokens.clear()
        else:
            tokens.difference_update(ev.token_ids)
        held = self.total[rid] = self.total.get(rid, 0) + len(tokens) - before
        self.series.setdefault(rid, []).append((id_ms(env.id), held))
        self.events.setdefault(rid, []).append(env.id)


def _decoded(stream: str, raw: list[tuple[str, bytes]]) -> list[Envelope]:
    out = []
    for entry_id, data in raw:
        try:
            out.append(Envelope(stream, entry_id, decode(data)))
        except DecodeError:
            continue
    return out


class ViewData:
    """The log as the viewer reads it, kept between requests (see the module docstring)."""

    def __init__(self, log: EventLog, *, tokenizer: Any | None = None) -> None:
        self.log = log
        self.tokenizer = tokenizer
        self._rollouts: dict[str, RolloutData] = {}
        self._first_ids: dict[str, str] = {}
        self._control_at: str | None = None
        self._quiesce_open: int | None = None
        self.bands: list[Band] = []
        self.servers: dict[str, list[tuple[int, str, str]]] = {}  # endpoint: (ms, state, why)
        self._pool = _Pool()
        self._lock = asyncio.Lock()

    async def rollout_ids(self) -> list[str]:
        """The rollouts whose stream is on the log, oldest first."""
        names = self.log.names
        streams = await self.log.list_streams(names.rollout_pattern)
        firsts = self._first_ids
        for s in streams:
            if s not in firsts:  # a stream's first entry stays (retention deletes it whole)
                firsts[s] = await self.log.first_id(s)
        ordered = sorted(streams, key=lambda s: parse_id(firsts[s] or "0-0"))
        return [rid for rid in (names.rollout_id_of(s) for s in ordered) if rid]

    async def rollout(self, rollout_id: str) -> RolloutData | None:
        """The rollout folded up to now (None: it has no stream)."""
        async with self._lock:
            data = self._rollouts.get(rollout_id)
            if data is None:
                data = RolloutData(rollout_id, self.log.names.rollout(rollout_id))
            with gc_paused():
                raw = await self.log.read_raw(data.stream, after=data.position, page=4096)
                if raw:
                    data.position = raw[-1][0]
                    data.feed(raw)
            if data.position is None:
                return None
            self._rollouts[rollout_id] = data
            await self._refresh_shared()
            return data

    async def _refresh_shared(self) -> None:
        names = self.log.names
        raw = await self.log.read_raw(names.control, after=self._control_at)
        if raw:
            self._control_at = raw[-1][0]
            for env in _decoded(names.control, raw):
                self._control(env)
        raw = await self.log.read_raw(names.pool, after=self._pool.position)
        if raw:
            self._pool.position = raw[-1][0]
            for env in _decoded(names.pool, raw):
                self._pool.feed(env)

    def _control(self, env: Envelope) -> None:
        ev, ms = env.event, id_ms(env.id)
        if isinstance(ev, QuiesceRequested):
            self._quiesce_open = ms if self._quiesce_open is None else self._quiesce_open
        elif isinstance(ev, QuiesceCompleted):
            start = ms if self._quiesce_open is None else self._quiesce_open
            self.bands.append(Band("quiesce", start, ms, ev.reason or "quiesce"))
            self._quiesce_open = None
        elif isinstance(ev, PolicyVersionActivated):
            self.bands.append(Band("version", ms, ms, f"v{ev.version}"))
        elif isinstance(ev, WeightSyncFailed):
            self.bands.append(Band("failed", ms, ms, f"sync v{ev.version} failed"))
        elif isinstance(ev, ServerUp):
            self.servers.setdefault(ev.endpoint, []).append((ms, "up", f"v{ev.weight_version}"))
        elif isinstance(ev, ServerDown):
            self.servers.setdefault(ev.endpoint, []).append((ms, "down", ev.reason))
        elif isinstance(ev, ServerStale):
            self.servers.setdefault(ev.endpoint, []).append((ms, "stale", ev.reason))

    def open_bands(self) -> list[Band]:
        """The bands, with a quiesce still open as one without an end."""
        out = list(self.bands)
        if self._quiesce_open is not None:
            out.append(Band("quiesce", self._quiesce_open, None, "quiesce (open)"))
        return out

    def pieces(self, token_ids: list[int]) -> list[str] | None:
        """Each token's text, with the tokenizer given (None: no tokenizer, ids only)."""
        if self.tokenizer is None:
            return None
        return [str(p) for p in self.tokenizer.batch_decode([[t] for t in token_ids])]

    def pool_series(self, rollout_id: str) -> list[tuple[int, int]]:
        return self._pool.series.get(rollout_id, [])

    def pool_events(self, rollout_id: str) -> list[str]:
        return self._pool.events.get(rollout_id, [])

    async def sample(self, data: RolloutData, sample_id: str) -> tuple[Rollout, list[Envelope]]:
        """The sample's entries read back (task, terminal, teacher, turns of the ending
        attempt) and every attempt's events in stream order."""
        rollout = await read_back(self.log, data.stream, data.state, [sample_id], turns=True)
        ids = data.events_of.get(sample_id, [])
        entries = await read_entries(self.log, data.stream, data.state, ids)
        return rollout, [Envelope(data.stream, i, entries[i]) for i in ids if i in entries]

    async def stamp(self, rollout_id: str | None) -> str:
        """What changes when a page would: the rollout's last entry (None: every stream's)."""
        if rollout_id is not None:
            data = await self.rollout(rollout_id)
            return "" if data is None else f"{data.position}|{len(self.bands)}"
        ids = await self.rollout_ids()
        return ";".join([*ids, *[await self.log.last_id(self.log.names.rollout(r)) for r in ids]])


def archive_log(archive: Archive) -> MemoryEventLog:
    """An in-memory log holding an archive's entries at their recorded ids."""
    prefix = archive.stream.partition(":{")[0]
    log = MemoryEventLog(names=StreamNames(prefix), producer="view")
    for entry_id, raw in archive.entries:
        log.append_fields(archive.stream, {FIELD: raw}, entry_id)
    return log
