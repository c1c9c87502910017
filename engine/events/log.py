"""The event log port: typed events on ordered streams, with consumer groups.

Implementations: :class:`engine.events.redis_log.RedisEventLog` (Redis Streams, what the
engine's processes run on) and :class:`engine.events.memory_log.MemoryEventLog` (one event
loop, for tests and embedding), both held to ``tests/events/test_log_contract.py``.

Contract
--------
* A stream id (``engine.events.ids``) is an event's position and identity; ids grow.
* ``append_if_last`` is the compare-and-append of single-writer invariants: it appends only
  if the stream's last id is the one the writer folded to, atomically with the follow-ups
  in ``also``, else raises :class:`AppendConflict` carrying the current last id.
* A typed read skips an entry that does not decode; a reader never crashes on one. Only
  the stream's owner (a consumer-group read, or ``dead_letter=True``) writes it to the
  dead-letter stream, once per entry however often it is read, acks it when it came
  through a group and counts it in ``dead_lettered``. Raw reads dead-letter nothing.
* Consumer groups deliver at least once. ``claim_idle`` and ``read_own_pending``
  dead-letter an entry delivered more than ``max_deliveries`` times and hand it back in
  ``dead`` so the caller can abort its work; with ``ack_dead=False`` it stays pending until
  the caller acks it once the abort is recorded, so a crash in between cannot forget it.
* ``append_once`` lands a copy once however many writers attempt it (marker and stream on
  one cluster slot).
* Blocking reads wait up to ``block_ms`` (None: the log's) and wake on an append;
  ``block_ms=0`` does not block.
* Store failures raise :class:`LogUnavailable` (unreachable) or :class:`LogError`
  (refused); refused credentials raise ``ConfigError``. ``aclose`` ends the log's use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.events.base import Envelope, Event
from engine.events.ids import EMPTY_ID
from engine.events.names import StreamNames

__all__ = ["EMPTY_ID", "ClaimResult", "DeadEntry", "EventLog", "RawEntry", "RawStreamEntry"]

RawEntry = tuple[str, bytes]
"""An entry as stored: ``(id, raw event bytes)``."""

RawStreamEntry = tuple[str, str, bytes]
"""An entry as stored, with its stream: ``(stream, id, raw event bytes)``."""


@dataclass(frozen=True, slots=True)
class DeadEntry:
    """An entry dead-lettered instead of delivered."""

    stream: str
    id: str
    error: str
    deliveries: int
    event: Event | None


@dataclass(slots=True)
class ClaimResult:
    entries: list[Envelope] = field(default_factory=list)
    deliveries: dict[str, int] = field(default_factory=dict)
    dead: list[DeadEntry] = field(default_factory=list)


class EventLog(Protocol):
    """Typed append / read / subscribe / compare-and-append over ordered streams."""

    names: StreamNames
    producer: str
    max_deliveries: int
    block_ms: int
    dead_lettered: int

    # ------------------------------------------------------------------ writing

    async def append(
        self, stream: str, event: Event, *, causation: Envelope | str | None = None
    ) -> str: ...

    async def append_many(
        self,
        items: Sequence[tuple[str, Event]],
        *,
        causation: Envelope | str | None = None,
    ) -> list[str]:
        """Append many events (to one or several streams) in one round trip, in order."""

    async def append_if_last(
        self,
        stream: str,
        events: Event | Sequence[Event],
        expected_last: str,
        *,
        also: Sequence[tuple[str, Event]] = (),
        causation: Envelope | str | None = None,
    ) -> list[str]:
        """Append iff the stream's last id is ``expected_last`` (``0-0``: empty), with
        ``also`` in the same atomic step (keys of one cluster slot, else ``LogError``);
        the ids of ``events``, then of ``also``."""

    async def append_once(
        self,
        stream: str,
        event: Event,
        marker: str,
        *,
        ttl_s: int = 86_400,
        causation: Envelope | str | None = None,
    ) -> str | None:
        """Append ``event`` and set ``marker`` (``names.once(...)``, expiring after
        ``ttl_s``) atomically unless it is set; the id, or None when it was."""

    async def last_id(self, stream: str) -> str:
        """The stream's last id (``0-0`` when empty or missing)."""

    async def first_id(self, stream: str) -> str:
        """The stream's first id (``0-0`` when empty or missing)."""

    # ------------------------------------------------------------------ reading

    async def read(
        self,
        stream: str,
        start: str = "-",
        end: str = "+",
        count: int | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Entries with ``start <= id <= end`` (``(id``: exclusive)."""

    async def read_all(
        self,
        stream: str,
        *,
        after: str | None = None,
        page: int = 2000,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Every entry after ``after`` (None: from the start)."""

    async def tail(
        self,
        positions: Mapping[str, str],
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Blocking read of entries after each stream's position (``$``: only new ones)."""

    async def read_after(
        self,
        stream: str,
        after: str,
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> tuple[list[Envelope], str]:
        """Blocking read of one stream past ``after``: the envelopes and the position to
        continue from (past dead-lettered entries too)."""

    def subscribe(
        self,
        stream: str,
        *,
        after: str = "$",
        block_ms: int | None = None,
        dead_letter: bool = False,
    ) -> AsyncIterator[Envelope]:
        """Yield every event appended after ``after``, forever (cancel to stop)."""

    async def read_raw(
        self, stream: str, *, after: str | None = None, page: int = 2000, limit: int | None = None
    ) -> list[RawEntry]:
        """The first ``limit`` (None: all) entries after ``after``, undecoded."""

    async def tail_raw(
        self, positions: Mapping[str, str], *, block_ms: int | None = None, count: int = 500
    ) -> list[RawStreamEntry]:
        """Blocking read past each stream's position, undecoded."""

    async def read_raw_ranges(
        self, stream: str, ranges: Sequence[tuple[str, str, int | None]]
    ) -> list[list[RawEntry]]:
        """For each ``(start, end, count)``: at most ``count`` (None: all) entries of
        that range, undecoded; one round trip."""

    async def list_streams(self, pattern: str) -> list[str]:
        """Names of the existing streams matching the glob ``pattern``, sorted."""

    async def stream_length(self, stream: str) -> int: ...

    # ------------------------------------------------------------------ groups

    async def ensure_group(self, stream: str, group: str, *, start: str = "0") -> None:
        """Create the group (and the stream) if missing; an existing group is kept."""

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Envelope]:
        """New entries for this consumer, each one delivery (idle from now)."""

    async def ack(self, stream: str, group: str, *ids: str) -> int: ...

    async def keep_alive(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Reset the idle time of entries this consumer still owns (no delivery counted);
        returns the ids it no longer owns."""

    async def hand_back(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Make unfinished entries claimable at once, taking back the delivery they were
        on; returns the ids the consumer no longer owned."""

    async def claim_idle(
        self,
        stream: str,
        group: str,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int = 100,
        ack_dead: bool = True,
    ) -> ClaimResult:
        """Take over entries idle past ``min_idle_ms``, one more delivery each. Idle time
        counts only while the server was up: a server restarted less than ``min_idle_ms``
        ago (its entries' idle times span the restart, their owners had no window to renew
        them) gives only what was handed back yet."""

    async def read_own_pending(
        self,
        group: str,
        consumer: str,
        stream: str,
        *,
        count: int = 10_000,
        limit: bool = True,
        ack_dead: bool = True,
    ) -> ClaimResult:
        """This consumer's unacked entries, one more delivery each; ``limit`` applies
        the delivery-count check of :meth:`claim_idle`."""

    async def unread_own_pending(
        self, group: str, consumer: str, stream: str, *, skip: Collection[str] = ()
    ) -> ClaimResult:
        """This consumer's pending entries but ``skip``, without counting a delivery (for
        a group read whose reply was lost); ``deliveries`` holds each one's count."""

    async def pending_count(self, stream: str, group: str) -> int: ...

    async def group_consumers(self, stream: str, group: str) -> dict[str, int]:
        """Each consumer of the group and its idle ms (since its last read, claim or
        keep-alive); empty when the stream or group is missing."""

    async def trim_acked(
        self, stream: str, *, before: str | None = None, require: Collection[str] = ()
    ) -> int:
        """Trim entries every group has acked (never below a pending or undelivered one);
        with ``before``, keep that id and every later one too; nothing while a group named
        in ``require`` does not exist."""

    async def trim_before(self, stream: str, keep_from: str) -> int:
        """Delete the entries below ``keep_from`` whoever reads them; how many (for a
        stream folded from a snapshot, ``rl:pool``)."""

    async def delete_stream(self, stream: str) -> bool:
        """Delete a stream and its consumer groups; whether it existed."""

    async def dead_marks(self) -> set[str]:
        """The dead-letter seen-set: ``stream@id`` of every entry a letter was written for."""
        ...

    async def forget_dead_marks(self, marks: Collection[str]) -> int:
        """Remove ``marks`` from the seen-set (their entries can no longer be read);
        returns how many were there."""
        ...

    # ------------------------------------------------------------------ snapshots, close

    async def write_snapshot(self, name: str, data: bytes) -> None: ...

    async def read_snapshot(self, name: str) -> bytes | None: ...

    async def aclose(self) -> None: ...
