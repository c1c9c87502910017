"""Weight sync through the log: the syncer actor, and what schedulers and workers do for it.

The saga (all on ``rl:control``; DESIGN "Policy versions and weight sync")
--------------------------------------------------------------------------
1. The trainer appends ``PolicyVersionPublished(version, weights_uri)``
   (``RolloutClient.publish_version``).
2. A syncer (consumer group ``sync``; any number of processes, one sync at a time) appends
   ``QuiesceRequested(version)`` with a compare-and-append on ``rl:control``: only one sync
   is ever open, and two syncers cannot both open one.
3. Schedulers stop admitting batches (before each admission, on their follower of
   ``rl:control``; a request whose ``policy_version`` is published but not active yet waits for
   its sync as well, so a rollout requested after a publication runs on the new weights);
   every evaluator worker closes its ``TurnGate`` (``engine/backends/gate.py``): generate
   calls in flight finish, none starts, so trajectories wait at a turn boundary with their
   whole state. With ``QuiesceRequested.interrupt`` (``SyncConfig.interrupt``, the default)
   the worker aborts its resumable calls instead of waiting for them (``TurnGate.interrupt``):
   each such turn waits with its partial tokens and continues from them on the new weights
   once the gate opens (``engine/backends/pool.py``), so the quiesce lasts an abort, not the
   longest turn in flight. A worker with nothing in flight appends ``WorkerParked(version,
   worker)``.
4. The syncer waits until every *live* worker is parked, then appends
   ``QuiesceCompleted(version, parked, unparked)``. Live workers are the consumers of the
   ``evaluators`` group on the work streams whose idle time (since their last read, claim or
   heartbeat) is below ``live_window_ms``: a worker that died, parked or not, drops out of the
   set once it has been silent that long. The wait is bounded as well: after
   ``park_timeout_s`` the sync goes on and ``unparked`` names the live workers that never said
   they were parked (their in-flight calls then still cannot straddle the update: SGLang, and
   tinylm, let running requests finish before they swap weights).
5. The syncer posts ``/update_weights_from_disk`` (the weights directory, ``weight_version``)
   to every model server the engine uses (the same ``--sglang-url`` list as the workers),
   with the admin key, then reads each one's ``/get_model_info`` ``weight_version``.
6. Every server reports the version: ``PolicyVersionActivated(version, servers)``; workers
   open their gates and schedulers admit again. Otherwise ``WeightSyncFailed(version, error,
   servers_ok, servers_failed)``: the engine is *poisoned* -- gates stay closed and admission
   paused until a later sync succeeds; the trainer's ``wait_ready`` and
   ``wait_version_active`` raise ``engine.errors.WeightSyncFailed`` with the error.

A policy server a worker finds answering at another version than the active one (restarted
from older weights, or started without ``--weight-version``) is reported as ``ServerStale``
on ``rl:control``; the syncer's group gets that event like a publication and loads the active
weights on that server alone (``/update_weights_from_disk``, then the reported version is
checked), with a few tries while the server finishes starting. No quiesce is needed: workers
give a stale server no turn until a probe finds it at the active version. A server the
syncer does not know, or a report older than the active version, is left alone; while a sync
is open the sync itself loads every server.

With ``servers_from_log`` the servers are the policy servers registered on ``rl:control``
when the weights are loaded (none is an activation too). A ``ServerRegistered`` reaches the
syncer's group as well: once no sync is open, the active weights are loaded on that server
unless it registered at the active version or an activation after it loaded them.

Ordering and recovery: the publication entry is acked only once its sync ended, so a syncer
that dies mid-saga leaves it pending and another syncer claims it and resumes (every step
checks the fold of ``rl:control`` first: quiesce is not requested twice, the outcome not
written twice; loading the same weights again is harmless). A publication delivered past
``max_deliveries`` (syncers keep dying on it) ends as ``WeightSyncFailed``, so an open
quiesce never holds the engine forever. A publication followed by a later one is
superseded (skipped) unless its sync is already open; one whose version (or a later one) is
already active after it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from engine.backends.gate import TurnGate
from engine.backends.weight_admin import ServerAdmin
from engine.errors import AppendConflict, BackendError, ConfigError
from engine.events.base import Envelope, Event
from engine.events.catalog import (
    PolicyVersionActivated,
    PolicyVersionPublished,
    QuiesceCompleted,
    QuiesceRequested,
    WeightSyncFailed,
    WorkerParked,
)
from engine.events.catalog.servers import ServerDown, ServerRegistered, ServerStale
from engine.events.ids import parse_id
from engine.events.log import DeadEntry, EventLog
from engine.projections.control import ControlProjection, ControlState
from engine.runtime.consumer import Backoff, Delivery, GroupConsumer, ride_out
from engine.runtime.follower import Follower, FollowerClosed, following
from engine.runtime.loop import HandBack, serve

__all__ = [
    "SYNC_GROUP",
    "SyncConfig",
    "WeightSyncer",
    "WorkerQuiesce",
    "weights_path",
]

logger = logging.getLogger(__name__)

SYNC_GROUP = "sync"
WORKER_GROUP = "evaluators"


def _later(a: str | None, b: str) -> bool:
    return a is not None and parse_id(a) > parse_id(b)


def weights_path(uri: str) -> str:
    """The local directory of ``weights_uri``: a plain path or a ``file://`` URI.

    ``ConfigError`` for anything else (the model servers load from their own disks)."""
    if not uri:
        raise ConfigError("weights_uri is empty: publish the directory the new weights are in")
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"weights_uri {uri!r}: a file:// URI must name a local path")
        return unquote(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # not a Windows drive letter
        raise ConfigError(
            f"weights_uri {uri!r}: only local directories (a path or file://) can be loaded "
            "with /update_weights_from_disk"
        )
    return uri


# ---------------------------------------------------------------------- the worker's side


class WorkerQuiesce:
    """An evaluator worker's part of the saga: its ``TurnGate`` follows the control state
    (the worker's follower of ``rl:control``), and it says ``WorkerParked`` once a quiesce
    found nothing in flight."""

    def __init__(
        self, log: EventLog, gate: TurnGate, *, worker_id: str, control: Follower[ControlState]
    ) -> None:
        self.log = log
        self.gate = gate
        self.worker_id = worker_id
        self.control = control
        self._reported: str | None = None  # the quiesce (its entry id) we said parked for
        self._parking: asyncio.Task[None] | None = None
        self.parked_for: list[int | None] = []

    async def start(self, backoff: Backoff) -> None:
        """The state as the log has it now, before any batch runs."""
        await ride_out(self.control.refresh, backoff, what="reading the control state")
        self._apply(self.control.state)

    async def run(self) -> None:
        """Steer the gate on every change of the control state until its follower closes."""
        control = self.control
        try:
            seen = -1
            while True:
                try:
                    await control.changed(seen)
                except FollowerClosed:
                    return
                seen = control.version
                self._apply(control.state)
        finally:
            if self._parking is not None:
                self._parking.cancel()
                await asyncio.gather(self._parking, return_exceptions=True)

    def _apply(self, state: ControlState) -> None:
        if state.generation_stopped:
            if self.gate.is_open:
                logger.info("worker %s: generation stopped: %s", self.worker_id,
                            state.why_stopped())
            self.gate.close(state.why_stopped())
        elif not self.gate.is_open:
            logger.info("worker %s: generation resumes on version %s", self.worker_id,
                        state.active_version)
            self.gate.open()
        quiesce = state.quiesce
        if quiesce is not None and quiesce.interrupt:
            self.gate.interrupt()
        if (
            quiesce is not None
            and state.quiesce_id != self._reported
            and self.worker_id not in state.parked
        ):
            self._reported = state.quiesce_id
            self._parking = asyncio.create_task(self._park(quiesce.version, state.quiesce_id))

    async def _park(self, version: int | None, quiesce_id: str | None) -> None:
        await self.gate.drained()
        if self.control.state.quiesce_id != quiesce_id:
            return  # that sync ended meanwhile
        await ride_out(
            lambda: self.log.append(
                self.log.names.control, WorkerParked(version=version, worker=self.worker_id)
            ),
            Backoff(),
            what="saying the worker is parked",
        )
        self.parked_for.append(version)
        logger.info("worker %s parked for the sync to version %s", self.worker_id, version)


# ---------------------------------------------------------------------- the syncer


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Settings of one syncer process.

    ``servers``: every model server to load the weights on (the workers' ``--sglang-url``);
    ``servers_from_log``: instead, those registered on ``rl:control`` (module docstring).
    ``admin_key``: the servers' admin key (``--admin-api-key``), if they have one.
    ``park_timeout_s``: the bound on waiting for workers to park. ``live_window_ms``: a
    worker silent on its work streams for longer is not waited for (default: the claim idle
    window, after which its work is taken over anyway). ``repush_tries`` / ``repush_pause_s``:
    tries at loading the active weights on a stale server, and the first pause between them
    (doubling). ``interrupt``: workers abort their resumable turns for the sync and continue
    them on the new weights instead of waiting for them (``QuiesceRequested.interrupt``).
    """

    syncer_id: str
    servers: tuple[str, ...]
    servers_from_log: bool = False
    admin_key: str | None = None
    group: str = SYNC_GROUP
    worker_group: str = WORKER_GROUP
    park_timeout_s: float = 120.0
    live_window_ms: int | None = None
    heartbeat_ms: int = 10_000
    claim_idle_ms: int = 60_000
    block_ms: int | None = None
    grace_s: float = 30.0
    outage_limit_s: float | None = 300.0
    repush_tries: int = 5
    repush_pause_s: float = 1.0
    interrupt: bool = True

    def __post_init__(self) -> None:
        if self.servers and self.servers_from_log:
            raise ConfigError(
                f"syncer {self.syncer_id!r}: servers named and taken from the log: set one"
            )
        if not self.servers and not self.servers_from_log:
            raise ConfigError(
                f"syncer {self.syncer_id!r}: no model server to sync (give --sglang-url, the "
                "servers the workers use)"
            )
        if self.park_timeout_s <= 0:
            raise ConfigError(f"park_timeout_s must be positive, got {self.park_timeout_s}")

    @property
    def live_ms(self) -> int:
        return self.live_window_ms if self.live_window_ms is not None else self.claim_idle_ms


AdminFactory = Callable[[str], ServerAdmin]


class WeightSyncer:
    """Runs the saga of the module docstring for each ``PolicyVersionPublished``."""

    def __init__(
        self,
        log: EventLog,
        config: SyncConfig,
        *,
        admin: AdminFactory | None = None,
        control: Follower[ControlState] | None = None,
    ) -> None:
        self.log = log
        self.config = config
        self._admin = admin or (lambda url: ServerAdmin(url, admin_key=config.admin_key))
        self.control = control or Follower(
            log, log.names.control, ControlProjection(), block_ms=config.block_ms,
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self.consumer = GroupConsumer(
            log,
            group=config.group,
            consumer=config.syncer_id,
            streams=[log.names.control],
            heartbeat_ms=config.heartbeat_ms,
            claim_idle_ms=config.claim_idle_ms,
            block_ms=config.block_ms,
            ack_dead=False,  # settled once the failure is recorded
            backoff=Backoff(limit_s=config.outage_limit_s),
        )
        self.outcomes: list[Event] = []
        # Per server, the version last loaded on it for a ServerStale (a server that
        # restarts again is reported stale again, after a ServerDown clears it).
        self._repushed: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        """Serve publications until ``stop``; an unfinished sync is handed back (another
        syncer, or this one restarted, resumes it from the log)."""
        await ride_out(self.control.refresh, self.consumer.backoff, what="reading rl:control")

        async def stopping() -> None:
            self.control.close()

        async with following(stop, self.control) as halt:
            await serve(
                self.consumer,
                halt,
                self._handle,
                on_dead=self._give_up,
                grace_s=self.config.grace_s,
                on_stopping=stopping,
            )

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers to load weights on now (module docstring)."""
        if self.config.servers_from_log:
            return self.control.state.registered_servers()
        return self.config.servers

    async def _handle(self, d: Delivery) -> None:
        ev = d.env.event
        try:
            if isinstance(ev, PolicyVersionPublished):
                await self.sync(d.env, ev)
            elif isinstance(ev, ServerStale):
                await self.repush(ev)
            elif isinstance(ev, ServerRegistered) and self.config.servers_from_log:
                await self.bring_up(d.env, ev)
            elif isinstance(ev, ServerDown):
                self._repushed.pop(ev.endpoint, None)  # it comes back from whatever it had
        except FollowerClosed as exc:  # stopping: another syncer resumes it
            raise HandBack from exc

    async def repush(self, stale: ServerStale) -> bool:
        """Load the active weights on the one server ``stale`` names (module docstring);
        whether it now reports the active version."""
        await self.control.refresh()
        state = self.control.state
        active = state.activated
        url = stale.endpoint
        if active is None or active.version != stale.active or state.quiesce is not None:
            return False  # nothing to bring it to, a newer version since, or a sync is open
        if url not in self.servers or not active.weights_uri:
            logger.warning("%s is stale (%s) but not a server this syncer loads", url,
                           stale.reason or f"reports {stale.weight_version}")
            return False
        if self._repushed.get(url) == active.version:
            return True  # another worker's report of the same restart
        return await self._load_active(url, active)

    async def bring_up(self, env: Envelope, registered: ServerRegistered) -> bool:
        """Load the active weights on a policy server registered on the log, once no sync is
        open (module docstring); whether it now serves the active version."""
        url = registered.endpoint
        if registered.role != "policy":
            return False
        await self.control.refresh()
        while self.control.state.quiesce is not None:  # the open sync ends first
            await self.control.changed(self.control.version, 1.0)
        state = self.control.state
        active = state.activated
        if active is None or url not in state.registered_servers():
            return False  # nothing active yet, or retired since
        if registered.weight_version == active.version or (
            _later(state.activated_id, env.id) and url in active.servers
        ):
            return True
        if not active.weights_uri:
            return False
        return await self._load_active(url, active)

    async def _load_active(self, url: str, active: PolicyVersionActivated) -> bool:
        """Load the active weights on one server, with a few tries (it may be starting)."""
        path = weights_path(active.weights_uri)
        pause = self.config.repush_pause_s
        for attempt in range(1, self.config.repush_tries + 1):
            error = await self._push_one(url, path, active.version)
            if error is None:
                logger.info("version %d loaded on %s", active.version, url)
                self._repushed[url] = active.version
                return True
            logger.warning("loading version %d on %s failed (try %d of %d): %s",
                           active.version, url, attempt, self.config.repush_tries, error)
            await asyncio.sleep(pause)
            pause *= 2
        return False

    async def _give_up(self, dead: DeadEntry) -> None:
        """A publication past ``max_deliveries`` (syncers kept dying on it): its sync ends as
        failed, so an open quiesce does not hold the engine forever."""
        ev = dead.event
        if not isinstance(ev, PolicyVersionPublished):
            return
        await self.control.refresh()
        if _ended_after(self.control.state, dead.id, ev.version):
            return
        failed = WeightSyncFailed(
            version=ev.version,
            error=f"the syncers gave up on the publication: {dead.error}",
            servers_ok=[],
            servers_failed=list(self.servers),
        )
        await self.log.append(self.control.stream, failed, causation=f"{dead.stream}@{dead.id}")
        self.outcomes.append(failed)

    # -- one publication -------------------------------------------------------------------

    async def sync(self, env: Envelope, publish: PolicyVersionPublished) -> None:
        """Run (or resume) the sync of one publication to its end."""
        ref, version = env.ref, publish.version
        await self.control.refresh()
        while True:
            seen, state = self.control.version, self.control.state
            if state.quiesce is not None and state.quiesce.causation == ref:
                break  # ours is open: resume it
            if _ended_after(state, env.id, version):
                return
            if _later(state.last_published_id, env.id):
                logger.info("version %d superseded by a later publication", version)
                return
            if state.quiesce is not None:  # another sync is open: it ends first
                await self.control.changed(seen, 1.0)
                continue
            request = QuiesceRequested(
                version=version, reason=f"weight sync to version {version}",
                interrupt=self.config.interrupt,
            )  # fmt: skip
            try:
                await self.log.append_if_last(
                    self.control.stream, request, self.control.position, causation=ref
                )
            except AppendConflict as exc:
                await self.control.refresh(at_least=exc.current)
                continue
            logger.info("quiesce requested for version %d", version)
            await self.control.refresh()
        await self._quiesce(version, ref)
        outcome = await self._push(publish)
        await self.log.append(self.control.stream, outcome, causation=ref)
        self.outcomes.append(outcome)
        await self.control.refresh()

    async def _quiesce(self, version: int, ref: str) -> None:
        deadline = time.monotonic() + self.config.park_timeout_s
        while True:
            seen, state = self.control.version, self.control.state
            if state.quiesce_done is not None:
                return  # written before a restart
            live = await self.live_workers()
            missing = live - state.parked
            left = deadline - time.monotonic()
            if not missing or left <= 0:
                if missing:
                    logger.warning(
                        "version %d: %d live workers did not park within %.0f s (%s); syncing "
                        "anyway", version, len(missing), self.config.park_timeout_s,
                        ", ".join(sorted(missing)),
                    )
                done = QuiesceCompleted(
                    version=version,
                    reason=f"weight sync to version {version}",
                    parked=sorted(state.parked),
                    unparked=sorted(missing),
                )
                await self.log.append(self.control.stream, done, causation=ref)
                await self.control.refresh()
                return
            # Woken by a WorkerParked (also one folded while the live set was read); the
            # live set is looked at again at least every second.
            await self.control.changed(seen, min(1.0, left))

    async def live_workers(self) -> set[str]:
        """Consumers of the worker group on any work stream, heard from within the window."""
        names = self.log.names
        live: set[str] = set()
        for stream in await self.log.list_streams(names.work_pattern):
            consumers = await self.log.group_consumers(stream, self.config.worker_group)
            live.update(name for name, idle in consumers.items() if idle < self.config.live_ms)
        return live

    async def _push(self, publish: PolicyVersionPublished) -> Event:
        version = publish.version
        servers = list(self.servers)
        try:
            path = weights_path(publish.weights_uri)
        except ConfigError as exc:
            return WeightSyncFailed(
                version=version, error=str(exc), servers_ok=[], servers_failed=servers
            )
        errors = await asyncio.gather(*(self._push_one(url, path, version) for url in servers))
        ok = [url for url, err in zip(servers, errors, strict=True) if err is None]
        failed = [(url, err) for url, err in zip(servers, errors, strict=True) if err is not None]
        if not failed:
            logger.info("version %d active on %s", version, ", ".join(ok))
            return PolicyVersionActivated(
                version=version, servers=ok, weights_uri=publish.weights_uri
            )
        error = "; ".join(f"{url}: {err}" for url, err in failed)
        logger.error("weight sync to version %d failed: %s", version, error)
        return WeightSyncFailed(
            version=version, error=error, servers_ok=ok, servers_failed=[u for u, _ in failed]
        )

    async def _push_one(self, url: str, path: str, version: int) -> str | None:
        """Load and verify on one server; the error text, or None."""
        admin = self._admin(url)
        try:
            await admin.load(path, version)
            reported = await admin.weight_version()
        except BackendError as exc:
            return str(exc)
        finally:
            await admin.aclose()
        if reported != str(version):
            return (
                f"after loading, the server reports weight_version {reported!r}, "
                f"expected {str(version)!r}"
            )
        return None


def _ended_after(state: ControlState, entry_id: str, version: int) -> bool:
    """A sync of ``version`` or later ended (either way) after the publication ``entry_id``."""
    active = state.activated
    if active is not None and active.version >= version and _later(state.activated_id, entry_id):
        return True
    failure = state.failure
    return (
        failure is not None and failure.version >= version and _later(state.failure_id, entry_id)
    )
