"""``rollout top``: a live view of the engine, built from the log alone.

Each refresh folds what was appended since the last one (the log is only read; an entry that
does not decode is skipped, never dead-lettered):

* rollouts: the latest ``RolloutRequested`` on ``rl:control``, each folded from its own
  stream with the rollout projection (planned, running, completed, aborted, READY / FAILED);
* pool: ``rl:pool`` folded with the placement projection (used / total per resource);
* workers: from the shown rollouts' ``SampleStarted`` events: samples running per worker and
  when it last started one;
* model servers: the last ``ServerUp`` / ``ServerDown`` / ``ServerStale`` of each policy
  server on ``rl:control`` (which worker said it, the version it reports, why, how long ago);
* lag: per consumer group and stream, the entries delivered but not acked (``pending``),
  plus, per rollout, the batches still to admit (sealed, not admitted: waiting for pool
  capacity) and those admitted that no worker has started yet (``queued``).

``--once`` prints one frame and exits (for scripts and tests); otherwise the frame is redrawn
every ``--interval`` seconds until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from engine.actors.admission import pool_figures
from engine.actors.capture import GROUP as CAPTURE_GROUP
from engine.actors.evaluator_worker import GROUP as EVALUATOR_GROUP
from engine.actors.finalizer import GROUP as FINALIZER_GROUP
from engine.actors.scheduler import SCHEDULER_GROUP
from engine.errors import DecodeError, EngineError
from engine.events.base import Envelope
from engine.events.catalog import RolloutRequested, SampleStarted
from engine.events.catalog.servers import ServerDown, ServerStale, ServerUp
from engine.events.codec import decode
from engine.events.ids import id_ms
from engine.events.log import EventLog
from engine.projections.base import Folded, Projection, Snapshottable, fold, start
from engine.projections.placement import PoolProjection, PoolState
from engine.projections.rollout import RolloutProjection, RolloutState
from engine.runtime.rebuild import load_snapshot

__all__ = [
    "LagRow", "RolloutRow", "ServerRow", "TopSource", "TopView", "WorkerRow", "render", "run_top"
]


@dataclass(frozen=True, slots=True)
class RolloutRow:
    rollout_id: str
    kind: str
    state: str
    planned: int | None
    started: int
    completed: int
    aborted: int
    waiting_admission: int
    queued: int
    age_s: float


@dataclass(frozen=True, slots=True)
class WorkerRow:
    worker: str
    running: int
    started: int
    last_start_s: float


@dataclass(frozen=True, slots=True)
class ServerRow:
    endpoint: str
    state: str
    worker: str
    version: str
    detail: str
    since_s: float


@dataclass(frozen=True, slots=True)
class LagRow:
    group: str
    stream: str
    length: int
    pending: int | None


@dataclass(frozen=True, slots=True)
class TopView:
    at: float
    rollouts: list[RolloutRow]
    pool: dict[tuple[str, str], float]
    gated: bool
    workers: list[WorkerRow]
    lag: list[LagRow]
    servers: list[ServerRow] = field(default_factory=list)


class _Tail:
    """One stream folded incrementally, reading raw entries (a viewer dead-letters nothing)."""

    def __init__(self, log: EventLog, stream: str, projection: Projection[Any]) -> None:
        self.log = log
        self.stream = stream
        self.projection = projection
        self.folded: Folded[Any] = start(projection)
        self.position: str | None = None

    async def refresh(self) -> list[Envelope]:
        """Fold the new tail; returns its envelopes."""
        if self.position is None and isinstance(self.projection, Snapshottable):
            snapshot = await load_snapshot(self.log, self.projection)  # rl:pool is trimmed
            if snapshot is not None:
                self.folded, self.position = snapshot, snapshot.position
        raw = await self.log.read_raw(self.stream, after=self.position)
        envelopes = []
        for entry_id, data in raw:
            self.position = entry_id
            try:
                envelopes.append(Envelope(self.stream, entry_id, decode(data)))
            except DecodeError:
                continue
        self.folded = fold(self.projection, self.folded, envelopes)
        return envelopes


@dataclass
class _Requests:
    """``rl:control`` as top needs it: requests in order, and which ended."""

    order: list[str] = field(default_factory=list)
    requested: dict[str, RolloutRequested] = field(default_factory=dict)
    requested_ms: dict[str, int] = field(default_factory=dict)
    servers: dict[str, tuple[ServerUp | ServerDown | ServerStale, int]] = field(
        default_factory=dict
    )
    position: str | None = None


class TopSource:
    """What ``rollout top`` reads, kept between refreshes so each reads only the new tail."""

    def __init__(self, log: EventLog, *, rollouts: int = 8) -> None:
        self.log = log
        self.n_rollouts = rollouts
        self._control = _Requests()
        self._pool = _Tail(log, log.names.pool, PoolProjection())
        self._rollouts: dict[str, _Tail] = {}
        self._worker_starts: dict[str, int] = {}
        self._worker_last_ms: dict[str, int] = {}

    async def _read_control(self) -> None:
        c = self._control
        for entry_id, data in await self.log.read_raw(self.log.names.control, after=c.position):
            c.position = entry_id
            try:
                ev = decode(data)
            except DecodeError:
                continue
            if isinstance(ev, RolloutRequested) and ev.rollout_id not in c.requested:
                c.order.append(ev.rollout_id)
                c.requested[ev.rollout_id] = ev
                c.requested_ms[ev.rollout_id] = id_ms(entry_id)
            elif isinstance(ev, ServerUp | ServerDown | ServerStale):
                c.servers[ev.endpoint] = (ev, id_ms(entry_id))

    async def snapshot(self) -> TopView:
        now = time.time()
        await self._read_control()
        shown = self._control.order[-self.n_rollouts :]
        for rid in list(self._rollouts):
            if rid not in shown:
                del self._rollouts[rid]
        await self._pool.refresh()
        rows: list[RolloutRow] = []
        running: dict[str, int] = {}
        for rid in reversed(shown):
            tail = self._rollouts.get(rid)
            if tail is None:
                tail = self._rollouts[rid] = _Tail(
                    self.log, self.log.names.rollout(rid), RolloutProjection()
                )
            for env in await tail.refresh():
                ev = env.event
                if isinstance(ev, SampleStarted) and ev.worker:
                    self._worker_starts[ev.worker] = self._worker_starts.get(ev.worker, 0) + 1
                    self._worker_last_ms[ev.worker] = id_ms(env.id)
            state: RolloutState = tail.folded.state
            rows.append(self._row(rid, state, now))
            for s in state.samples.values():
                if s.worker and not s.done:
                    running[s.worker] = running.get(s.worker, 0) + 1
        pool: PoolState = self._pool.folded.state
        return TopView(
            at=now,
            rollouts=rows,
            pool=pool_figures(pool),
            gated=pool.gated,
            workers=[
                WorkerRow(w, running.get(w, 0), n,
                          max(0.0, now - self._worker_last_ms[w] / 1000))
                for w, n in sorted(self._worker_starts.items())
            ],
            lag=await self._lag(),
            servers=[_server_row(ev, ms, now) for ev, ms in
                     (self._control.servers[url] for url in sorted(self._control.servers))],
        )

    def _row(self, rid: str, state: RolloutState, now: float) -> RolloutRow:
        request = self._control.requested[rid]
        samples = state.samples.values()
        if state.ready is not None:
            verdict = "READY" + (" (dummy)" if state.ready.dummy else "")
        elif state.failed is not None:
            verdict = "FAILED"
        elif state.planned is None:
            verdict = "planning"
        else:
            verdict = "running"
        started_batches = {s.batch_id for s in samples if s.started}
        pool: PoolState = self._pool.folded.state
        admitted = {batch for (r, batch) in pool.acquired if r == rid}
        return RolloutRow(
            rollout_id=rid,
            kind=request.kind.value,
            state=verdict,
            planned=state.planned.n_samples if state.planned is not None else None,
            started=sum(1 for s in samples if s.started or s.done),
            completed=sum(1 for s in samples if s.completed),
            aborted=sum(1 for s in samples if s.aborted),
            waiting_admission=0 if state.decided else len(set(state.batches) - admitted),
            queued=0 if state.decided else len(admitted - started_batches),
            age_s=max(0.0, now - self._control.requested_ms[rid] / 1000),
        )

    async def _lag(self) -> list[LagRow]:
        names = self.log.names
        pairs = [(SCHEDULER_GROUP, names.control), (FINALIZER_GROUP, names.control)]
        work = await self.log.list_streams(names.work_pattern)
        pairs += [(EVALUATOR_GROUP, stream) for stream in work]
        pairs.append((CAPTURE_GROUP, names.capture))
        rows = []
        for group, stream in pairs:
            length = await self.log.stream_length(stream)
            if length == 0:
                continue
            try:
                pending: int | None = await self.log.pending_count(stream, group)
            except EngineError:  # no such group yet: nobody has read the stream
                pending = None
            rows.append(LagRow(group, stream, length, pending))
        return rows


def _server_row(ev: ServerUp | ServerDown | ServerStale, ms: int, now: float) -> ServerRow:
    since = max(0.0, now - ms / 1000)
    if isinstance(ev, ServerUp):
        return ServerRow(ev.endpoint, "up", ev.worker, _version(ev.weight_version), "", since)
    if isinstance(ev, ServerDown):
        return ServerRow(ev.endpoint, "DOWN", ev.worker, "-", ev.reason, since)
    return ServerRow(ev.endpoint, "STALE", ev.worker, _version(ev.weight_version),
                     f"needs a sync to {ev.active}", since)


def _version(version: int | None) -> str:
    return "default" if version is None else str(version)


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render(view: TopView) -> Group:
    """One frame: rollouts, pool, workers, model servers (once one was reported), lag."""
    stamp = dt.datetime.fromtimestamp(view.at, tz=dt.UTC).strftime("%H:%M:%S UTC")
    rollouts = Table(title=f"rollouts (newest first, {stamp})", title_justify="left")
    for col in ("rollout", "kind", "state", "planned", "started", "completed", "aborted",
                "to admit", "queued", "age"):
        left = col in ("rollout", "kind", "state")
        rollouts.add_column(col, justify="left" if left else "right", no_wrap=True)
    for r in view.rollouts:
        planned = "?" if r.planned is None else str(r.planned)
        rollouts.add_row(r.rollout_id, r.kind, r.state, planned, str(r.started),
                         str(r.completed), str(r.aborted), str(r.waiting_admission),
                         str(r.queued), _ago(r.age_s))
    pool = Table(title="pool" + ("" if view.gated else " (ungated: no layout declared)"),
                 title_justify="left")
    for col in ("resource", "used", "total", "use"):
        pool.add_column(col, justify="left" if col == "resource" else "right")
    for resource in ("cpu", "gpu", "memory_gb", "tokens", "batches"):
        used = view.pool.get((resource, "used"), 0.0)
        total = view.pool.get((resource, "total"))
        share = f"{100 * used / total:.0f}%" if total else "-"
        pool.add_row(resource, f"{used:g}", "-" if total is None else f"{total:g}", share)
    workers = Table(title="workers (seen in the rollouts shown)", title_justify="left")
    for col in ("worker", "running", "started", "last start"):
        workers.add_column(col, justify="left" if col == "worker" else "right")
    for w in view.workers:
        workers.add_row(w.worker, str(w.running), str(w.started), f"{_ago(w.last_start_s)} ago")
    servers = Table(title="model servers (as the workers last said)", title_justify="left")
    for col in ("server", "state", "worker", "version", "since", "why"):
        servers.add_column(col, justify="right" if col == "since" else "left")
    for srv in view.servers:
        servers.add_row(srv.endpoint, srv.state, srv.worker, srv.version, _ago(srv.since_s),
                        srv.detail[:80])
    lag = Table(title="consumer groups", title_justify="left")
    for col in ("group", "stream", "entries", "pending"):
        lag.add_column(col, justify="left" if col in ("group", "stream") else "right")
    for row in view.lag:
        lag.add_row(row.group, row.stream, str(row.length),
                    "no group" if row.pending is None else str(row.pending))
    return Group(rollouts, pool, workers, *([servers] if view.servers else []), lag)


async def run_top(
    log: EventLog,
    *,
    once: bool,
    interval_s: float = 1.0,
    rollouts: int = 8,
    console: Console | None = None,
) -> None:
    """Print one frame (``once``) or redraw one every ``interval_s`` until cancelled."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a file: no width to fit, keep lines whole
            console = Console(width=160)
    source = TopSource(log, rollouts=rollouts)
    if once:
        console.print(render(await source.snapshot()))
        return
    first = render(await source.snapshot())
    with Live(first, console=console, auto_refresh=False, vertical_overflow="visible") as live:
        while True:
            await asyncio.sleep(interval_s)
            live.update(render(await source.snapshot()), refresh=True)
