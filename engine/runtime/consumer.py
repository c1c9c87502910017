"""One consumer of a consumer group, with the at-least-once mechanics every actor needs.

``GroupConsumer.fetch(count)`` hands out deliveries in this order:

1. on the first call, the consumer's *own* pending entries (a restarted process with the
   same consumer name resumes exactly what it held), marked ``redelivered``;
2. when a claim is due (every half idle window), entries of *other* consumers idle past
   ``claim_idle_ms`` (their owner died), marked ``redelivered``;
3. otherwise new entries, with a blocking read (no sleep-polling).

Entries of 2. (and of 1. with ``limit_own_pending``: a restart counts as a delivery, so a
consumer crash-looping on one entry dead-letters it) delivered more than the log's
``max_deliveries`` times come back separately as dead entries (already on the dead-letter
stream) so the caller can abort the work they stood for. By default the log acks them at
once. With ``ack_dead=False`` they stay pending, kept alive by the heartbeat, until the
caller calls ``settle`` after recording the abort: a crash before that leaves them to be
claimed and aborted again.

Every delivery handed out is *in flight* until ``ack`` (done), ``release`` (its work failed:
left pending for a claim after the idle window) or ``hand_back`` (a graceful stop: left
pending, claimable at once, and not counted as a delivery). A read can deliver more than a
fetch hands out (a group read counts per stream, and restarts and claims return what they
find): the rest waits in the backlog for the next fetch. A heartbeat task refreshes the idle
time of every entry the consumer holds -- in flight, in the backlog, dead and not settled --
every ``heartbeat_ms``, so a live consumer's entries are never claimed, whether they run or
wait for a free slot; it must be well below ``claim_idle_ms``. An entry the heartbeat finds
claimed by another consumer is dropped from the backlog (it never runs here) or, in flight,
reported to ``on_lost``. An entry that a claim returns while it is already in flight here is
skipped, so nothing runs twice in one process.

``fetch_or_stop`` is what an actor's loop calls (see :mod:`engine.runtime.loop`). A stop
never cancels a Redis command (redis-py does not reliably survive a cancelled read): the
read in progress finishes, at most ``block_ms`` later, and whatever it delivered is handed
back at once. A read that fails (Redis unavailable) is retried after a capped exponential
:class:`Backoff`, which resets on the next successful read; one place for every actor. A
backoff with ``limit_s`` raises :class:`~engine.errors.OutageExceeded` once Redis has been
unreachable for longer than that: the process exits with that error instead of waiting
forever. :func:`ride_out` retries one operation the same way.

Ownership is a lease kept by the heartbeat. Redis counts an entry's idle time from its last
delivery or keep-alive, and a restart (AOF or RDB) keeps those times, so after an outage
every live consumer's entries look idle for as long as Redis was away. A consumer therefore
claims nothing until two heartbeats after it started, and nothing until a whole claim
window after Redis answered it again: an owner is held to the same window after an outage
as at any other time (two heartbeats were too short a margin on a loaded machine), and
only work whose owner really died is claimed. A failed read and a failed heartbeat both
count as Redis not answering: a consumer with every slot busy reads nothing, and only its
heartbeat sees the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from engine import metrics
from engine.errors import LogError, LogUnavailable, OutageExceeded
from engine.events.base import Envelope
from engine.events.log import DeadEntry, EventLog

__all__ = ["Backoff", "Delivery", "GroupConsumer", "ride_out"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class Backoff:
    """Pauses between failed attempts: ``first_s``, then ``factor`` times longer each time,
    never more than ``max_s``; ``reset()`` (a success) starts again from ``first_s``.

    With ``limit_s``, failures that have gone on for longer than ``limit_s`` since the
    first of them (no success in between) raise :class:`OutageExceeded` instead of
    pausing: the outage is longer than the operator allows.
    """

    first_s: float = 1.0
    max_s: float = 30.0
    factor: float = 2.0
    failures: int = 0
    limit_s: float | None = None
    failing_since: float | None = None

    def __post_init__(self) -> None:
        if self.first_s <= 0 or self.max_s < self.first_s or self.factor < 1:
            raise ValueError(
                f"backoff needs 0 < first_s <= max_s and factor >= 1, got first_s="
                f"{self.first_s}, max_s={self.max_s}, factor={self.factor}"
            )
        if self.limit_s is not None and self.limit_s <= 0:
            raise ValueError(f"the outage limit must be positive, got {self.limit_s}")

    def next_pause(self, error: BaseException | str = "") -> float:
        """The pause after one more failure (``error``: what failed, for the fatal message)."""
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        elif self.limit_s is not None and now - self.failing_since > self.limit_s:
            raise OutageExceeded(
                f"Redis unreachable for {now - self.failing_since:.0f} s, longer than the "
                f"outage limit of {self.limit_s:g} s (ROLLOUT_OUTAGE_LIMIT_S); giving up. "
                f"Last error: {error}"
            )
        pause = min(self.first_s * self.factor ** min(self.failures, 64), self.max_s)
        if self.limit_s is not None:  # wake in time to give up at the limit, not later
            pause = min(pause, max(self.failing_since + self.limit_s - now, 0.0) + 0.01)
        self.failures += 1
        return pause

    def reset(self) -> None:
        self.failures = 0
        self.failing_since = None

    @property
    def failing(self) -> bool:
        """Whether the last attempt failed (no success since)."""
        return self.failing_since is not None


async def ride_out(
    op: Callable[[], Awaitable[T]],
    backoff: Backoff,
    *,
    what: str,
    stop: asyncio.Event | None = None,
) -> T:
    """Run ``op`` until it gets through Redis: a :class:`LogUnavailable` (a transport error,
    never a refusal) is retried after ``backoff``'s next pause; past the backoff's outage
    limit :class:`OutageExceeded` is raised. Only for operations that may be repeated (an
    ack, a keep-alive, a flush whose duplicates the folds ignore). A set ``stop`` cuts a
    pause short and re-raises the last error instead of waiting on."""
    own = Backoff(
        first_s=backoff.first_s, max_s=backoff.max_s, factor=backoff.factor,
        limit_s=backoff.limit_s,
    )
    while True:
        try:
            return await op()
        except LogUnavailable as exc:
            pause = own.next_pause(exc)
            logger.warning("%s failed (retrying in %.1f s): %s", what, pause, exc)
            if stop is not None:
                if stop.is_set():
                    raise
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), pause)
            else:
                await asyncio.sleep(pause)


@dataclass(frozen=True, slots=True)
class Delivery:
    """An entry handed to this consumer; ``redelivered`` when someone may have run it."""

    env: Envelope
    redelivered: bool = False
    deliveries: int = 1

    @property
    def key(self) -> tuple[str, str]:
        return (self.env.stream, self.env.id)


class GroupConsumer:
    """See the module docstring."""

    def __init__(
        self,
        log: EventLog,
        *,
        group: str,
        consumer: str,
        streams: Sequence[str],
        heartbeat_ms: int,
        claim_idle_ms: int,
        block_ms: int | None = None,
        ack_dead: bool = True,
        limit_own_pending: bool = False,
        backoff: Backoff | None = None,
    ) -> None:
        if heartbeat_ms >= claim_idle_ms:
            raise ValueError(
                f"heartbeat ({heartbeat_ms} ms) must be below the claim idle window "
                f"({claim_idle_ms} ms), or live consumers lose their entries"
            )
        self.log = log
        self.group = group
        self.consumer = consumer
        self.streams = list(streams)
        self.heartbeat_ms = heartbeat_ms
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = log.block_ms if block_ms is None else block_ms
        self._in_flight: dict[tuple[str, str], Delivery] = {}
        self._backlog: list[Delivery] = []
        self._dead: list[DeadEntry] = []
        self.ack_dead = ack_dead
        self.limit_own_pending = limit_own_pending
        self._dead_held: set[tuple[str, str]] = set()
        self._own_pending_read = False
        # After a failed group read: entries it may have delivered whose reply was lost.
        self._recheck_own = False
        # Entries left pending on purpose (released, dead dropped): a claim takes them.
        self._left: set[tuple[str, str]] = set()
        # Owners re-assert their leases (heartbeat) before this consumer claims anything:
        # see the module docstring.
        self._next_claim = time.monotonic() + 2 * heartbeat_ms / 1000.0
        self._claim_every_s = max(claim_idle_ms / 2000.0, 0.05)
        self._heartbeat: asyncio.Task[None] | None = None
        self.backoff = backoff or Backoff()
        self.claim_rounds = 0
        # Called (by the heartbeat) for an in-flight delivery another consumer now owns.
        self.on_lost: Callable[[Delivery], None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    async def ensure_groups(self) -> None:
        """Create the consumer group on every stream (an existing group is kept)."""
        for stream in self.streams:
            await self.log.ensure_group(stream, self.group)

    async def start(self) -> None:
        """Ensure the groups and start the heartbeat."""
        await self.ensure_groups()
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(
                self._beat(), name=f"heartbeat-{self.group}"
            )

    async def aclose(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
            self._heartbeat = None

    async def fetch(self, count: int) -> tuple[list[Delivery], list[DeadEntry]]:
        """Up to ``count`` deliveries (and any dead entries found); blocks when idle."""
        if count < 1:
            return [], []
        if not self._own_pending_read:
            for stream in self.streams:
                result = await self.log.read_own_pending(
                    self.group,
                    self.consumer,
                    stream,
                    count=100_000,
                    limit=self.limit_own_pending,
                    ack_dead=self.ack_dead,
                )
                for env in result.entries:
                    times = result.deliveries.get(env.id, 2)
                    self._backlog.append(Delivery(env, redelivered=True, deliveries=times))
                self._hold_dead(result.dead)
            self._own_pending_read = True
        if self._recheck_own:
            await self._recover_lost_reads()
        if time.monotonic() >= self._next_claim:
            self._next_claim = time.monotonic() + self._claim_every_s
            await self._claim(count)
        if not self._backlog and not self._dead:
            block_ms = self.block_ms
            if block_ms > 0:  # wake for the next claim round rather than sleep through it
                until_claim = int((self._next_claim - time.monotonic()) * 1000)
                block_ms = max(1, min(block_ms, until_claim))
            for env in await self.log.read_group(
                self.group, self.consumer, self.streams, count=count, block_ms=block_ms
            ):
                self._backlog.append(Delivery(env))
        out: list[Delivery] = []
        while self._backlog and len(out) < count:
            d = self._backlog.pop(0)
            if d.key in self._in_flight:
                continue
            self._in_flight[d.key] = d
            out.append(d)
        dead, self._dead = self._dead, []
        return out, dead

    async def fetch_or_stop(
        self, count: int, stop_wait: asyncio.Task[object]
    ) -> tuple[list[Delivery], list[DeadEntry]] | None:
        """``fetch(count)``, unless ``stop_wait`` (a task waiting on the caller's stop
        event) finishes first, or with a read that succeeded: then the read is let finish
        (never cancelled), what it delivered is handed back, and None comes back. A read
        that fails (Redis unavailable) is logged and comes back empty after the next
        backoff pause (cut short by a stop), so the caller's loop carries on and
        reconnects."""
        fetch = asyncio.get_running_loop().create_task(self.fetch(count))
        await asyncio.wait([fetch, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if not fetch.done() or (stop_wait.done() and fetch.exception() is None):
            try:
                deliveries, dead = await fetch
            except LogError:
                return None
            for entry in dead:
                self.drop_dead(entry)  # pending: a later claim hands it out again
            await self.hand_back(deliveries)
            return None
        try:
            fetched = fetch.result()
        except LogError as exc:
            metrics.REDIS_ERRORS.labels("read").inc()
            pause = self.backoff.next_pause(exc)  # past the outage limit: OutageExceeded
            logger.error(
                "%s: reading %s failed (retrying in %.1f s): %s",
                self.consumer, ", ".join(self.streams), pause, exc,
            )
            self._recheck_own = True
            self._defer_claims(pause)
            await asyncio.wait([stop_wait], timeout=pause)
            return [], []
        self.backoff.reset()
        return fetched

    def _defer_claims(self, retry_in_s: float) -> None:
        """A call to Redis failed and is retried in ``retry_in_s``: Redis may be away, and
        when it answers again every owner's entries look idle for as long as it was. Redis
        is back by that retry at the latest (or the retry fails and defers again); from
        then on the owners get a whole claim window to re-assert, as they always do."""
        self._next_claim = max(
            self._next_claim, time.monotonic() + retry_in_s + self.claim_idle_ms / 1000.0
        )

    async def _recover_lost_reads(self) -> None:
        """A group read failed: Redis may have delivered entries whose reply never
        arrived. They are this consumer's pending entries that it is neither working on,
        holding, nor left pending on purpose; taken up here without counting a delivery
        (a transport error is not one), instead of waiting to be claimed as one."""
        for stream in self.streams:
            known = {i for s, i in (*self._in_flight, *self._dead_held, *self._left)
                     if s == stream}
            known |= {d.env.id for d in self._backlog if d.env.stream == stream}
            result = await self.log.unread_own_pending(
                self.group, self.consumer, stream, skip=known
            )
            for env in result.entries:
                times = result.deliveries.get(env.id, 1)
                self._backlog.append(Delivery(env, redelivered=True, deliveries=times))
            if result.entries:
                logger.info("%s took up %d entries of %s a lost read delivered",
                            self.consumer, len(result.entries), stream)
        self._recheck_own = False

    async def _claim(self, count: int) -> None:
        """Claim idle entries, no more than there is room for beside the backlog: what a
        consumer cannot run soon is left for one that can."""
        self.claim_rounds += 1
        for stream in self.streams:
            room = count - len(self._backlog)
            if room <= 0:
                return
            result = await self.log.claim_idle(
                stream,
                self.group,
                self.consumer,
                min_idle_ms=self.claim_idle_ms,
                count=room,
                ack_dead=self.ack_dead,
            )
            for env in result.entries:
                key = (env.stream, env.id)
                if key in self._in_flight:
                    continue
                self._left.discard(key)
                # A copy read earlier (its heartbeat failed for a window): the claim is newer.
                self._backlog = [d for d in self._backlog if d.key != key]
                times = result.deliveries.get(env.id, 2)
                self._backlog.append(Delivery(env, redelivered=True, deliveries=times))
            self._hold_dead(result.dead)
            if result.entries or result.dead:
                logger.info(
                    "%s claimed %d idle entries of %s (%d dead-lettered)",
                    self.consumer,
                    len(result.entries),
                    stream,
                    len(result.dead),
                )

    def _hold_dead(self, dead: Sequence[DeadEntry]) -> None:
        for entry in dead:
            key = (entry.stream, entry.id)
            if key in self._dead_held:
                continue  # already handed out and not settled yet
            if not self.ack_dead:
                self._dead_held.add(key)
            self._dead.append(entry)

    async def settle(self, entry: DeadEntry) -> None:
        """The abort a dead entry stood for is recorded: ack it (``ack_dead=False`` only)."""
        key = (entry.stream, entry.id)
        if key in self._dead_held:
            await self.log.ack(entry.stream, self.group, entry.id)
            self._dead_held.discard(key)

    def drop_dead(self, entry: DeadEntry) -> None:
        """Give up on settling ``entry`` for now: it stays pending, the heartbeat stops, and
        a claim after the idle window hands it out (as dead) again."""
        self._dead_held.discard((entry.stream, entry.id))
        self._left.add((entry.stream, entry.id))

    async def handle_dead(
        self, dead: Sequence[DeadEntry], handler: Callable[[DeadEntry], Awaitable[None]]
    ) -> None:
        """Run ``handler`` on each dead entry and settle the entry once it has returned.
        When the handler cannot reach Redis the entry is dropped for now (see
        ``drop_dead``) and the next claim hands it out again."""
        for entry in dead:
            try:
                await handler(entry)
            except LogError as exc:
                self.drop_dead(entry)
                logger.error(
                    "%s: dead entry %s of %s left for a later claim: %s",
                    self.consumer, entry.id, entry.stream, exc,
                )
                continue
            try:
                await self.settle(entry)
            except LogError as exc:  # still pending and held: the next claim settles it
                self.drop_dead(entry)
                logger.error(
                    "%s: settling dead entry %s of %s failed: %s",
                    self.consumer, entry.id, entry.stream, exc,
                )

    async def ack(self, delivery: Delivery) -> None:
        """The delivery's effects are recorded: acknowledge it and stop its heartbeat."""
        self._in_flight.pop(delivery.key, None)
        await self.log.ack(delivery.env.stream, self.group, delivery.env.id)

    def release(self, delivery: Delivery) -> None:
        """Stop keeping the delivery alive (its work failed); it stays pending and another
        consumer claims it after the idle window, as a further delivery."""
        self._in_flight.pop(delivery.key, None)
        self._left.add(delivery.key)

    async def hand_back(self, deliveries: Sequence[Delivery]) -> None:
        """Give back deliveries a graceful stop leaves unfinished: they stay pending but
        are claimable at once, and the hand-back does not count as a delivery (see
        ``EventLog.hand_back``). If Redis cannot be reached they are only released."""
        by_stream: dict[str, list[str]] = {}
        for d in deliveries:
            self._in_flight.pop(d.key, None)
            by_stream.setdefault(d.env.stream, []).append(d.env.id)
        for stream, ids in by_stream.items():
            try:
                await self.log.hand_back(stream, self.group, self.consumer, ids)
            except LogError as exc:
                logger.warning(
                    "%s: handing back %d entries of %s failed (claimable after the idle "
                    "window instead): %s", self.consumer, len(ids), stream, exc,
                )

    def take_backlog(self) -> list[Delivery]:
        """Entries read (own pending, claimed) but not handed out yet: a stopping actor
        hands them back with its unfinished work."""
        backlog, self._backlog = self._backlog, []
        return [d for d in backlog if d.key not in self._in_flight]

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_ms / 1000.0)
            by_stream: dict[str, list[str]] = {}
            held = [*self._in_flight, *self._dead_held, *(d.key for d in self._backlog)]
            for stream, entry_id in dict.fromkeys(held):
                by_stream.setdefault(stream, []).append(entry_id)
            for stream, ids in by_stream.items():
                try:
                    lost = await self.log.keep_alive(stream, self.group, self.consumer, ids)
                except Exception as exc:  # a missed beat is retried on the next one
                    logger.warning("heartbeat on %s failed: %s", stream, exc)
                    # A consumer whose every slot is busy reads nothing, so its heartbeat
                    # is what sees an outage: it must not claim right after one either.
                    self._defer_claims(self.heartbeat_ms / 1000.0)
                    continue
                if lost:
                    self._lost(stream, set(lost))

    def _lost(self, stream: str, lost: set[str]) -> None:
        """Entries another consumer claimed after this one failed to keep them alive for a
        whole idle window: the lease is gone, so their work stops here and runs only at the
        new owner; what this consumer still writes is fenced (newer lease, newer attempts)."""
        self._backlog = [
            d for d in self._backlog if d.env.stream != stream or d.env.id not in lost
        ]
        for entry_id in lost:
            self._dead_held.discard((stream, entry_id))  # its new owner settles it
            delivery = self._in_flight.pop((stream, entry_id), None)
            logger.warning(
                "%s: entry %s on %s was claimed by another consumer; %s", self.consumer,
                entry_id, stream, "stopping its work here" if delivery else "dropped",
            )
            if delivery is not None and self.on_lost is not None:
                self.on_lost(delivery)
