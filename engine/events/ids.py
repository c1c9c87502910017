"""Stream ids (``<ms>-<seq>``): parsed, compared and stepped here, and nowhere else.

Ids order as ``(ms, seq)`` integer pairs, never as text (``"10-0" < "9-0"``). ``EMPTY_ID``
is an empty stream's position, below every entry; a bare ``<ms>`` reads as ``<ms>-0``.
"""

from __future__ import annotations

__all__ = [
    "EMPTY_ID", "MAX_SEQ", "exclusive", "format_id", "id_after", "id_before", "id_ms",
    "later_id", "parse_id",
]

EMPTY_ID = "0-0"
MAX_SEQ = 2**64 - 1


def parse_id(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int = 0) -> str:
    return f"{ms}-{seq}"


def id_ms(stream_id: str) -> int:
    return int(stream_id.partition("-")[0])


def later_id(a: str, b: str) -> str:
    return a if parse_id(a) >= parse_id(b) else b


def id_after(stream_id: str) -> str:
    """The smallest id past ``stream_id``."""
    ms, seq = parse_id(stream_id)
    return format_id(ms, seq + 1) if seq < MAX_SEQ else format_id(ms + 1, 0)


def id_before(stream_id: str) -> str:
    """The position just before ``stream_id`` (a read after it includes the entry);
    ``0-0`` stays ``0-0``."""
    ms, seq = parse_id(stream_id)
    if seq > 0:
        return format_id(ms, seq - 1)
    return format_id(ms - 1, MAX_SEQ) if ms > 0 else EMPTY_ID


def exclusive(stream_id: str) -> str:
    """A range bound that excludes ``stream_id`` itself (XRANGE ``(id``)."""
    return f"({stream_id}"
