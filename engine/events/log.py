"""The event log port: typed events on ordered streams, with consumer groups.

:class:`EventLog` is what actors, projections' rebuilds, the client and the operator tools
talk to. Two implementations: :class:`engine.events.redis_log.RedisEventLog` on Redis
Streams (built with :func:`engine.events.redis_log.open_log`), which the engine's processes
run on, and :class:`engine.events.memory_log.MemoryEventLog`, plain Python in one event
loop, for tests and embedding. The contract suite ``tests/events/test_log_contract.py``
holds both to it (and Redis both real and fakeredis).

Contract
--------
* A stream id (``engine.events.ids``) is an event's position and identity; ids grow.
* ``append`` / ``append_many`` write events (``append_many`` in one round trip);
  ``append_if_last`` is the compare-and-append used by single-writer invariants: it appends
  only if the stream's last id is the one the writer folded to, atomically, together with
  the follow-up appends in ``also``, else raises :class:`AppendConflict` carrying the
  current last id.
* Every typed read decodes and validates, and skips an entry that does not: a reader never
  crashes on a bad entry. Only the stream's owner writes it to the dead-letter stream (with
  its source stream, id, raw bytes and the reason), once per entry however often it is
  read: a consumer-group read, or a read with ``dead_letter=True`` (the owner of a stream
  without a group). The entry is acked when it came through a group and counted in
  ``dead_lettered``; other readers write nothing. The raw reads (``read_raw``,
  ``tail_raw``) return the stored bytes undecoded and dead-letter nothing (archives and
  viewers).
* Consumer groups give at-least-once delivery (the methods say how each counts a delivery
  and moves an entry's idle time). ``claim_idle`` and ``read_own_pending`` check delivery
  counts: an entry delivered more than ``max_deliveries`` times is dead-lettered instead
  and handed back to the caller so it can abort the work it stood for. With
  ``ack_dead=False`` it stays pending (owned by the caller) until the caller acks it once
  the abort is recorded, so a crash in between leaves it to be dead-lettered and aborted
  again, never forgotten.
* ``append_once`` appends an event only if its marker key was not set before, atomically
  (marker and stream on one cluster slot): a copy that several writers may attempt, or one
  writer may retry after a crash, lands once.
* Snapshots are opaque bytes stored by name beside the streams. ``trim_before`` drops a
  stream's entries below an id whatever reads it (a stream folded from a snapshot).
* Blocking reads wait up to ``block_ms`` (None: the log's ``block_ms``) for a new entry and
  wake as soon as one is appended; ``block_ms=0`` does not block.
* Failures of the store raise :class:`LogUnavailable` (cannot reach it) or
  :class:`LogError` (it refused); credentials it refuses raise ``ConfigError``. An
  implementation translates its own exceptions.
* ``aclose`` releases the connections; the log is unusable afterwards.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from engine.events.base import Envelope, Event
from engine.events.ids import EMPTY_ID
from engine.events.names import StreamNames

__all__ = [
    "EMPTY_ID",
    "ClaimResult",
    "DeadEntry",
    "EventLog",
    "RawEntry",
    "RawStreamEntry",
]

RawEntry = tuple[str, bytes]
"""An entry as stored: ``(id, raw event bytes)``."""

RawStreamEntry = tuple[str, str, bytes]
"""An entry as stored, with its stream: ``(stream, id, raw event bytes)``."""


@dataclass(frozen=True, slots=True)
class DeadEntry:
    """An entry that was dead-lettered instead of delivered."""

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
        ...

    async def append_if_last(
        self,
        stream: str,
        events: Event | Sequence[Event],
        expected_last: str,
        *,
        also: Sequence[tuple[str, Event]] = (),
        causation: Envelope | str | None = None,
    ) -> list[str]:
        """Append atomically iff the stream's last id is ``expected_last`` (``0-0``: empty),
        with the follow-ups ``also`` in the same step; returns the ids of the guarded
        events followed by those of ``also``."""
        ...

    async def append_once(
        self,
        stream: str,
        event: Event,
        marker: str,
        *,
        ttl_s: int = 86_400,
        causation: Envelope | str | None = None,
    ) -> str | None:
        """Append ``event`` unless ``marker`` (a key, e.g. ``names.once(...)``) is set, and
        set it, in one atomic step; the id, or None when the marker was already set. The
        marker expires after ``ttl_s``."""
        ...

    async def last_id(self, stream: str) -> str:
        """The stream's last id (``0-0`` when empty or missing)."""
        ...

    async def first_id(self, stream: str) -> str:
        """The stream's first id (``0-0`` when empty or missing): where a trim left it."""
        ...

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
        """Entries with ``start <= id <= end`` (use ``(id`` for an exclusive start)."""
        ...

    async def read_all(
        self,
        stream: str,
        *,
        after: str | None = None,
        page: int = 2000,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Every entry after ``after`` (exclusive; None = from the start), paging through."""
        ...

    async def tail(
        self,
        positions: Mapping[str, str],
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        """Blocking read of entries after each stream's position (``$``: only new ones)."""
        ...

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
        continue from, past dead-lettered entries too. ``block_ms=0`` does not block."""
        ...

    def subscribe(
        self,
        stream: str,
        *,
        after: str = "$",
        block_ms: int | None = None,
        dead_letter: bool = False,
    ) -> AsyncIterator[Envelope]:
        """Yield every event appended after ``after``, forever (cancel to stop)."""
        ...

    async def read_raw(
        self, stream: str, *, after: str | None = None, page: int = 2000, limit: int | None = None
    ) -> list[RawEntry]:
        """Every entry after ``after`` (None: from the start), undecoded; with ``limit``,
        only the first ``limit`` of them."""
        ...

    async def tail_raw(
        self, positions: Mapping[str, str], *, block_ms: int | None = None, count: int = 500
    ) -> list[RawStreamEntry]:
        """Blocking read past each stream's position, undecoded, dead-lettering nothing."""
        ...

    async def read_raw_ranges(
        self, stream: str, ranges: Sequence[tuple[str, str, int | None]]
    ) -> list[list[RawEntry]]:
        """For each ``(start, end, count)``: the entries with ``start <= id <= end``
        (``(id``: exclusive), at most ``count`` (None: all), undecoded; one round trip."""
        ...

    async def list_streams(self, pattern: str) -> list[str]:
        """Names of the existing streams matching the glob ``pattern``, sorted."""
        ...

    async def stream_length(self, stream: str) -> int: ...

    # ------------------------------------------------------------------ groups

    async def ensure_group(self, stream: str, group: str, *, start: str = "0") -> None:
        """Create the group (and the stream) if missing; an existing group is kept."""
        ...

    async def read_group(
        self,
        group: str,
        consumer: str,
        streams: Sequence[str],
        *,
        count: int = 100,
        block_ms: int | None = None,
    ) -> list[Envelope]:
        """New entries for this consumer, each one delivery (idle from now); its own
        unacked ones: ``read_own_pending``."""
        ...

    async def ack(self, stream: str, group: str, *ids: str) -> int: ...

    async def keep_alive(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Reset the idle time of entries this consumer still owns (no delivery counted);
        returns the ids it no longer owns."""
        ...

    async def hand_back(
        self, stream: str, group: str, consumer: str, ids: Sequence[str]
    ) -> list[str]:
        """Give back unfinished entries: claimable at once, and the delivery they were on
        is taken back; returns the ids the consumer no longer owned."""
        ...

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
        """Take over entries idle past ``min_idle_ms`` (a dead consumer's work), one more
        delivery each."""
        ...

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
        """This consumer's own unacked entries (a restart resumes them), one more delivery
        each; ``limit`` applies the delivery-count check of :meth:`claim_idle`."""
        ...

    async def unread_own_pending(
        self, group: str, consumer: str, stream: str, *, skip: Collection[str] = ()
    ) -> ClaimResult:
        """This consumer's pending entries other than ``skip``, read without counting a
        delivery: after a group read whose reply was lost (the entries were delivered to
        the consumer, which never saw them). ``deliveries`` holds each entry's count."""
        ...

    async def pending_count(self, stream: str, group: str) -> int: ...

    async def group_consumers(self, stream: str, group: str) -> dict[str, int]:
        """The consumers of ``group`` on ``stream`` and how long each has been idle, in ms
        (since its last read, claim or keep-alive); empty when the stream or group is missing."""
        ...

    async def trim_acked(
        self, stream: str, *, before: str | None = None, require: Collection[str] = ()
    ) -> int:
        """Trim entries every group has acked (never below a pending or undelivered one);
        with ``before``, keep that id and every later one too; nothing while a group named
        in ``require`` does not exist."""
        ...

    async def trim_before(self, stream: str, keep_from: str) -> int:
        """Delete the entries with ids below ``keep_from``; returns how many. For a stream
        without consumer groups whose readers start from a snapshot (``rl:pool``)."""
        ...

    async def delete_stream(self, stream: str) -> bool:
        """Delete a stream and its consumer groups; whether it existed."""
        ...

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
