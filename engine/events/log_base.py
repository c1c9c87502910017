"""What every :class:`~engine.events.log.EventLog` implementation shares, so they cannot
drift apart: encoding, decoding stored entries, and the dead-letter rules.

An entry is a mapping with one field, :data:`FIELD`, holding the encoded event. One that
does not decode is dead-lettered by the stream's owner and skipped, with one warning, by
every other reader. An implementation supplies the abstract store operations.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from engine.errors import DecodeError
from engine.events.base import Envelope, Event
from engine.events.catalog import DeadLetter
from engine.events.codec import decode, encode
from engine.events.log import ClaimResult, DeadEntry
from engine.events.names import StreamNames

__all__ = ["FIELD", "HAND_BACK_IDLE_MS", "LogBase", "gc_paused"]

FIELD = b"e"

HAND_BACK_IDLE_MS = 10**10
"""How idle a handed-back entry is made: past any claim window, so it is claimable at once."""

logger = logging.getLogger(__name__)

Row = tuple[Any, Any]
"""``(id as bytes or str, fields)``; fields None: the entry was deleted while pending."""


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while a large acyclic result is built (a read, a
    rebuild, a client's load); nests. Collections meanwhile would only re-traverse the
    growing result, whose objects reference counting frees anyway."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class LogBase(ABC):
    """Encoding, decoding and dead-lettering over an implementation's store operations."""

    def __init__(
        self,
        *,
        names: StreamNames | None,
        producer: str,
        max_deliveries: int,
        block_ms: int,
    ) -> None:
        self.names = names or StreamNames()
        self.producer = producer
        self.max_deliveries = max_deliveries
        self.block_ms = block_ms
        self.dead_lettered = 0
        self._skipped: set[tuple[str, str]] = set()  # undecodable entries already logged

    @abstractmethod
    async def _write_letters(self, letters: Sequence[tuple[str, bytes]]) -> int:
        """Append each encoded letter, keyed ``stream@id``, to the dead-letter stream unless
        a letter for that key was written before (atomically); how many it appended."""

    @abstractmethod
    async def ack(self, stream: str, group: str, *ids: str) -> int: ...

    @abstractmethod
    async def last_id(self, stream: str) -> str: ...

    @abstractmethod
    async def read_after(
        self,
        stream: str,
        after: str,
        *,
        block_ms: int | None = None,
        count: int = 500,
        dead_letter: bool = False,
    ) -> tuple[list[Envelope], str]: ...

    def _encode(self, event: Event, causation: Envelope | str | None) -> bytes:
        producer = self.producer if self.producer and not event.producer else None
        ref = causation.ref if isinstance(causation, Envelope) else causation
        return encode(event, producer=producer, causation=ref)

    async def _decode_rows(
        self,
        stream: str,
        rows: Sequence[Row],
        group: str | None = None,
        *,
        dead_letter: bool = False,
    ) -> list[Envelope]:
        out: list[Envelope] = []
        bad: list[tuple[str, bytes, str]] = []
        gone: list[str] = []
        with gc_paused():
            for raw_id, fields in rows:
                entry_id = _s(raw_id)
                if fields is None:  # deleted while pending
                    gone.append(entry_id)
                    continue
                raw = fields.get(FIELD)
                if raw is None:
                    bad.append((entry_id, b"", f"entry has no {FIELD.decode()!r} field"))
                    continue
                try:
                    out.append(Envelope(stream, entry_id, decode(raw)))
                except DecodeError as exc:
                    bad.append((entry_id, raw, str(exc)))
        if bad and (group is not None or dead_letter):
            await self._dead_letter(stream, bad, group=group)
        elif bad:  # not this reader's to dead-letter: its owner does, once
            for entry_id, _raw, error in bad:
                if (stream, entry_id) not in self._skipped:
                    self._skipped.add((stream, entry_id))
                    logger.warning("skipping undecodable entry %s of %s: %s",
                                   entry_id, stream, error)
        if gone and group is not None:
            await self.ack(stream, group, *gone)
        return out

    async def _dead_letter(
        self,
        stream: str,
        bad: Sequence[tuple[str, bytes, str]],
        *,
        group: str | None,
        deliveries: Mapping[str, int] | None = None,
        ack: bool = True,
    ) -> None:
        letters = [
            (
                f"{stream}@{entry_id}",
                self._encode(
                    DeadLetter(
                        source_stream=stream,
                        source_id=entry_id,
                        raw=raw,
                        error=error,
                        group=group,
                        deliveries=(deliveries or {}).get(entry_id, 0),
                    ),
                    None,
                ),
            )
            for entry_id, raw, error in bad
        ]
        written = await self._write_letters(letters)
        if group is not None and ack:
            await self.ack(stream, group, *(entry_id for entry_id, _, _ in bad))
        self.dead_lettered += written

    async def _split_deliveries(
        self,
        stream: str,
        group: str,
        rows: Sequence[Row],
        times: Mapping[str, int],
        *,
        ack_dead: bool,
    ) -> ClaimResult:
        """Dead-letter the rows delivered more than ``max_deliveries`` times (``times``)
        and return them as dead; decode the others."""
        result = ClaimResult()
        over: list[Row] = []
        keep: list[Row] = []
        for raw_id, fields in rows:
            entry_id = _s(raw_id)
            result.deliveries[entry_id] = n = times.get(entry_id, 1)
            (over if n > self.max_deliveries else keep).append((raw_id, fields))
        if over:
            bad: list[tuple[str, bytes, str]] = []
            for raw_id, fields in over:
                entry_id = _s(raw_id)
                raw = (fields or {}).get(FIELD, b"")
                n = result.deliveries[entry_id]
                error = f"delivered {n} times (limit {self.max_deliveries}) without an ack"
                try:
                    event: Event | None = decode(raw)
                except DecodeError:
                    event = None
                bad.append((entry_id, raw, error))
                result.dead.append(DeadEntry(stream, entry_id, error, n, event))
            await self._dead_letter(
                stream, bad, group=group, deliveries=result.deliveries, ack=ack_dead
            )
        result.entries = await self._decode_rows(stream, keep, group=group)
        return result

    async def subscribe(
        self,
        stream: str,
        *,
        after: str = "$",
        block_ms: int | None = None,
        dead_letter: bool = False,
    ) -> AsyncIterator[Envelope]:
        """Positions advance over stored ids, so a dead-lettered entry is not read twice."""
        position = await self.last_id(stream) if after == "$" else after
        block = block_ms or self.block_ms
        while True:
            envs, position = await self.read_after(
                stream, position, block_ms=block, dead_letter=dead_letter
            )
            for env in envs:
                yield env
