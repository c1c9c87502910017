"""Archive a rollout's stream to a file and replay a rollout from the log or an archive.

Archive format (``rollout archive ID --out FILE``): a sequence of msgpack values. The first
is a header map ``{"format": "rollout-archive", "version": 1, "stream": <stream name>,
"rollout_id": <id>, "count": <entries>}``; each following value is a two-element array
``[<stream id>, <raw event bytes>]``, in stream order, exactly as stored in Redis (an entry
that does not decode is archived as it is and skipped on replay, as a live reader would).

Replay folds the entries with ``RolloutProjection`` up to and including the first
``RolloutReady`` -- the state the live finalizer wrote its artifacts from -- and writes the
artifacts with :func:`engine.actors.artifacts.write_artifacts`, so the files are
byte-identical to the live run's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from engine.actors.artifacts import write_artifacts
from engine.errors import DecodeError, RolloutError
from engine.events.base import Envelope
from engine.events.catalog import RolloutReady
from engine.events.codec import decode
from engine.events.log import EventLog, RawEntry
from engine.projections.base import fold, start
from engine.projections.rollout import RolloutProjection, RolloutState

__all__ = [
    "ARCHIVE_FORMAT",
    "Archive",
    "RawEntry",
    "archive_rollout",
    "decode_entries",
    "raw_entries",
    "read_archive",
    "replay_state",
    "replay_to_dir",
    "write_archive",
]

ARCHIVE_FORMAT = "rollout-archive"
ARCHIVE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Archive:
    stream: str
    rollout_id: str
    entries: list[RawEntry]


async def raw_entries(log: EventLog, stream: str, *, page: int = 2000) -> list[RawEntry]:
    """Every entry of ``stream`` as ``(id, raw bytes)``, undecoded."""
    return await log.read_raw(stream, page=page)


def write_archive(path: str | os.PathLike[str], archive: Archive) -> int:
    """Write an archive file (atomically); returns the number of entries."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        packer = msgpack.Packer(use_bin_type=True)
        header = {
            "format": ARCHIVE_FORMAT,
            "version": ARCHIVE_VERSION,
            "stream": archive.stream,
            "rollout_id": archive.rollout_id,
            "count": len(archive.entries),
        }
        fh.write(packer.pack(header))
        for entry_id, raw in archive.entries:
            fh.write(packer.pack([entry_id, raw]))
    os.replace(tmp, target)
    return len(archive.entries)


async def archive_rollout(log: EventLog, rollout_id: str, path: str | os.PathLike[str]) -> int:
    """Archive every event of the rollout's stream to ``path``; returns the count."""
    stream = log.names.rollout(rollout_id)
    entries = await raw_entries(log, stream)
    if not entries:
        raise RolloutError(f"rollout {rollout_id}: stream {stream} is empty or missing")
    return write_archive(path, Archive(stream, rollout_id, entries))


def _values(fh: BinaryIO) -> Iterator[Any]:
    unpacker = msgpack.Unpacker(fh, raw=False, strict_map_key=True, max_buffer_size=2**31 - 1)
    yield from unpacker


def read_archive(path: str | os.PathLike[str]) -> Archive:
    """Read an archive file; a file that is not one raises ``DecodeError`` naming it."""
    with open(path, "rb") as fh:
        values = _values(fh)
        try:
            header = next(values)
        except StopIteration:
            raise DecodeError(f"{path}: empty file, not a rollout archive") from None
        except Exception as exc:
            raise DecodeError(f"{path}: not a rollout archive ({exc})") from exc
        if not isinstance(header, dict) or header.get("format") != ARCHIVE_FORMAT:
            raise DecodeError(f"{path}: not a rollout archive (no {ARCHIVE_FORMAT!r} header)")
        if header.get("version") != ARCHIVE_VERSION:
            raise DecodeError(f"{path}: archive version {header.get('version')} is not supported")
        entries: list[RawEntry] = []
        for value in values:
            if (
                not isinstance(value, list)
                or len(value) != 2
                or not isinstance(value[0], str)
                or not isinstance(value[1], bytes)
            ):
                raise DecodeError(f"{path}: entry {len(entries)} is not [id, bytes]")
            entries.append((value[0], value[1]))
    if header.get("count") != len(entries):
        raise DecodeError(
            f"{path}: header says {header.get('count')} entries, file holds {len(entries)} "
            f"(truncated?)"
        )
    return Archive(str(header["stream"]), str(header["rollout_id"]), entries)


def decode_entries(stream: str, entries: Iterable[RawEntry]) -> tuple[list[Envelope], int]:
    """Decode raw entries; returns the envelopes and how many did not decode."""
    out: list[Envelope] = []
    bad = 0
    for entry_id, raw in entries:
        try:
            out.append(Envelope(stream, entry_id, decode(raw)))
        except DecodeError:
            bad += 1
    return out, bad


def replay_state(envelopes: Iterable[Envelope]) -> RolloutState:
    """Fold a rollout stream up to and including its first ``RolloutReady``."""
    envs = list(envelopes)
    until = next((e.id for e in envs if isinstance(e.event, RolloutReady)), None)
    projection = RolloutProjection()
    return fold(projection, start(projection), envs, until=until).state


def replay_to_dir(state: RolloutState, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the artifacts of a replayed rollout (the same function the finalizer uses)."""
    if state.ready is None:
        raise RolloutError(
            f"rollout {state.rollout_id} has no RolloutReady: nothing to replay yet "
            f"({state.n_done} of {len(state.samples)} samples terminal)"
        )
    return write_artifacts(state, out_dir)
