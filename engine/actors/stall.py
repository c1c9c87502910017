"""A stalled rollout says what it waits for.

The finalizer following a rollout keeps a :class:`StallWatch`: when the rollout's stream
has had no new entry (its own ``RolloutStalled`` aside) for ``window_s`` seconds, it appends
a ``RolloutStalled`` naming what the rollout waits for, and again every window while the
stall lasts. What to say is :func:`decide_stall`, a pure function of the rollout fold, the
pool fold, the policy fold (weight syncs), what the log last said of each policy server, the
consumers of the work streams and the clock values passed in; the watch only gathers those
and appends.

The stages, upstream first (each named only when it holds unfinished samples):

* the plan: no ``RolloutPlanned`` yet;
* admission: sealed batches the pool has not placed, with the cause the scheduler waits on:
  an open weight sync or a failed one (generation poisoned), every policy server down or
  stale, the request's version not yet active, its staleness bound out of reach or its
  ``pace`` policy holding it, else the placement pool (tokens held);
* policy servers (while samples are unfinished): each one the log last said is down or stale,
  since when (the entry that said so first), by which worker, and why: a down server's error,
  a stale one's version against the active one (``servers_said`` folds ``ServerDown`` /
  ``ServerStale`` / ``ServerUp`` from ``rl:control``);
* workers: admitted batches none of whose unfinished samples has started, with the
  consumers of their ``rl:work:<evaluator>`` stream and how long each has been idle (none:
  no worker serves the evaluator);
* a pinned version (an eval's ``pinned_version``) that no registered eval server serves and
  the policy is not at, while samples are unfinished: the servers registered, and the fix;
* samples running: how many, on which workers;
* teacher scores: a capture asked for and not all scored yet.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from engine.actors.evaluator_worker import GROUP as WORK_GROUP
from engine.actors.planning import admission_wait, pace_wait
from engine.events.base import Envelope
from engine.events.catalog import BatchSealed
from engine.events.catalog.diagnostics import RolloutStalled
from engine.events.catalog.servers import ServerDown, ServerStale, ServerUp
from engine.events.ids import id_ms
from engine.events.log import EventLog
from engine.projections.control import ControlProjection, ControlState
from engine.projections.placement import PoolProjection, PoolState
from engine.projections.rollout import RolloutState
from engine.runtime.follower import Follower

__all__ = ["ServerWord", "StallWatch", "decide_stall", "servers_said"]


@dataclass(frozen=True, slots=True)
class ServerWord:
    """The log's word on one policy server: the entry that put it in its current state
    (``since``, a stream id) and the latest event about it."""

    since: str
    said: ServerDown | ServerStale | ServerUp


def servers_said(servers: Mapping[str, ServerWord], env: Envelope) -> Mapping[str, ServerWord]:
    """``servers`` with ``env`` folded in (an entry that is no server event changes nothing)."""
    ev = env.event
    if not isinstance(ev, ServerDown | ServerStale | ServerUp):
        return servers
    word = servers.get(ev.endpoint)
    since = word.since if word is not None and word.said.type == ev.type else env.id
    return {**servers, ev.endpoint: ServerWord(since, ev)}


def decide_stall(
    state: RolloutState,
    pool: PoolState,
    policy: ControlState,
    consumers: Mapping[str, Mapping[str, int]],
    *,
    idle_s: float,
    since_report_s: float | None,
    window_s: float,
    servers: Mapping[str, ServerWord] | None = None,
) -> RolloutStalled | None:
    """The ``RolloutStalled`` to append, or None: the rollout is decided, moved within the
    window, or was reported less than a window ago (``since_report_s``; None: never).
    ``consumers``: per evaluator id, the consumers of its work stream and their idle ms;
    ``servers``: the log's word on each policy server (``servers_said``)."""
    if state.decided or idle_s < window_s:
        return None
    if since_report_s is not None and since_report_s < window_s:
        return None
    waits: list[str] = []
    if state.planned is None:
        waits.append("the plan: no RolloutPlanned yet (no scheduler has planned the request)")
    not_admitted: list[BatchSealed] = []
    not_started: list[BatchSealed] = []
    for batch in state.batches.values():
        unfinished = [r for s in batch.sample_ids if (r := state.samples.get(s)) and not r.done]
        if not unfinished:
            continue
        if not pool.has_acquired(batch.rollout_id, batch.batch_id):
            not_admitted.append(batch)
        elif not any(r.started for r in unfinished):
            not_started.append(batch)
    if not_admitted:
        waits.append(f"admission of {len(not_admitted)} batches: "
                     f"{_admission_cause(state, pool, policy)}")
    running = Counter(r.worker for r in state.samples.values() if r.worker and not r.done)
    out = [o for u, w in sorted((servers or {}).items()) if (o := _out_of_service(u, w))]
    if out and (not_admitted or not_started or running):
        waits.append("policy servers not serving: " + "; ".join(out))
    shown: dict[str, int] = {}
    if not_started:
        lines = []
        for evaluator in sorted({b.evaluator_id for b in not_started}):
            held = dict(consumers.get(evaluator, {}))
            shown.update(held)
            who = ", ".join(f"{c} idle {ms / 1000:.1f} s" for c, ms in sorted(held.items()))
            lines.append(f"rl:work:{evaluator} " + (f"consumed by {who}" if who
                                                    else "has no consumer (no worker serves it)"))
        waits.append(f"workers for {len(not_started)} admitted batches: " + "; ".join(lines))
    pinned = state.request.pinned_version if state.request is not None else None
    if pinned is not None and (not_started or running) and (why := _unserved(pinned, policy)):
        waits.append(why)
    if running:
        on = ", ".join(f"{w} ({n})" for w, n in sorted(running.items()))
        waits.append(f"{sum(running.values())} samples running on {on}")
    if state.capture is not None:
        waits.append(f"teacher scores: {state.n_scored} of {len(state.capture.sample_ids)} "
                     f"samples scored (capture workers)")
    if not waits:
        waits.append("every sample is terminal: the finalizer's decision")
    return RolloutStalled(
        rollout_id=state.rollout_id or (state.request.rollout_id if state.request else ""),
        idle_s=round(idle_s, 3),
        waiting_for=waits,
        not_admitted=len(not_admitted),
        not_started=len(not_started),
        running=dict(running),
        consumers=shown,
    )


def _unserved(version: int, policy: ControlState) -> str:
    """What a rollout pinned to ``version`` waits for when no server registered serves it
    (empty: one is registered at it, or the policy is at it)."""
    evals = {u: r.weight_version for u, r in policy.registered.items() if r.role == "eval"}
    if version in evals.values() or policy.active_version == version:
        return ""
    shown = ", ".join(f"{u} (version {v})" for u, v in evals.items()) or "none"
    return (f"a model server serving weight version {version}, the version the rollout is "
            f"pinned to (active policy version {policy.active_version}; eval servers "
            f"registered: {shown}): start one with rollout serve --role eval --model PATH "
            f"--weight-version {version}")


def _out_of_service(url: str, word: ServerWord) -> str:
    """What keeps ``url`` from serving, or "" when it is up."""
    said = word.said
    if isinstance(said, ServerUp):
        return ""
    when = datetime.fromtimestamp(id_ms(word.since) / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(said, ServerDown):
        return f"{url} down since {when} UTC (worker {said.worker}): {said.reason[:300]}"
    shown = 'unknown ("default")' if said.weight_version is None else str(said.weight_version)
    return (f"{url} stale since {when} UTC (worker {said.worker}): it reports weight version "
            f"{shown}, the active one is {said.active}")


def _admission_cause(state: RolloutState, pool: PoolState, policy: ControlState) -> str:
    """What the scheduler's admission of the rollout waits on."""
    if policy.failure is not None:
        return (f"generation is poisoned by the failed weight sync of version "
                f"{policy.failure.version} (a later sync must succeed)")
    if policy.quiesce is not None:
        version = "" if policy.quiesce.version is None else f" of version {policy.quiesce.version}"
        return (f"the weight sync{version} is open "
                f"({len(policy.parked)} workers parked)")
    if policy.servers_down:
        return "every policy server is down or stale"
    request = state.request
    if request is not None and policy.needs_sync(request.policy_version):
        return f"version {request.policy_version} is published but not active yet"
    stale = admission_wait(state, policy.published) or pace_wait(request, policy)
    if stale is not None:
        return stale
    return (f"the placement pool ({pool.tokens_held} tokens held by {len(pool.held)} "
            f"batches)")


class StallWatch:
    """The finalizer's side of :func:`decide_stall` for the rollouts it follows: the clock of
    each rollout's last progress, and the pool, policy and consumers read when one is due."""

    def __init__(
        self,
        log: EventLog,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        group: str = WORK_GROUP,
    ) -> None:
        self.log = log
        self.window_s = window_s
        self.clock = clock
        self.group = group
        self._pool = Follower(log, log.names.pool, PoolProjection())
        self._policy = Follower(log, log.names.control, _PolicyFold())
        self._lock = asyncio.Lock()  # one refresh of the shared folds at a time
        # per rollout: entries seen (less its own reports), when that last grew, last report
        self._seen: dict[str, tuple[int, float, float | None, int]] = {}

    def forget(self, rollout_id: str) -> None:
        self._seen.pop(rollout_id, None)

    async def check(self, stream: str, state: RolloutState) -> RolloutStalled | None:
        """Append (and return) a ``RolloutStalled`` when one is due for this rollout."""
        rid = state.rollout_id
        if rid is None or state.decided:
            return None
        now = self.clock()
        seen, moved_at, reported_at, reports = self._seen.get(rid, (-1, now, None, 0))
        entries = state.n_entries - reports
        if entries > seen:  # progress (its own reports are not)
            seen, moved_at = entries, now
        self._seen[rid] = (seen, moved_at, reported_at, reports)
        idle = now - moved_at
        since = None if reported_at is None else now - reported_at
        if idle < self.window_s or (since is not None and since < self.window_s):
            return None
        async with self._lock:
            await self._pool.refresh()
            await self._policy.refresh()
        consumers = {
            e: await self.log.group_consumers(self.log.names.work(e), self.group)
            for e in {b.evaluator_id for b in state.batches.values()}
        }
        policy = self._policy.state
        stalled = decide_stall(
            state, self._pool.state, policy.control, consumers,
            idle_s=idle, since_report_s=since, window_s=self.window_s, servers=policy.servers,
        )
        if stalled is not None:
            await self.log.append(stream, stalled)
            self._seen[rid] = (seen, moved_at, now, reports + 1)
        return stalled


@dataclass(frozen=True, slots=True)
class _Policy:
    control: ControlState
    servers: Mapping[str, ServerWord]


class _PolicyFold:
    """``rl:control`` folded once for the watch: the control state and ``servers_said``."""

    def __init__(self) -> None:
        self._control = ControlProjection()

    def initial(self) -> _Policy:
        return _Policy(self._control.initial(), {})

    def evolve(self, state: _Policy, env: Envelope) -> _Policy:
        control = self._control.evolve(state.control, env)
        servers = servers_said(state.servers, env)
        if control is state.control and servers is state.servers:
            return state
        return _Policy(control, servers)
