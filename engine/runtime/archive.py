"""The rollout archive file: one rollout stream's raw entries, written and read back by
the retention loop and the operator tools alike.

Format: a sequence of msgpack values. The first is a header map ``{"format":
"rollout-archive", "version": 1, "stream": <stream name>, "rollout_id": <id>, "count":
<entries>}``; each following value is ``[<stream id>, <raw event bytes>]``, in stream
order, as stored (an entry that does not decode is kept, and skipped on replay).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgpack

from engine.errors import DecodeError
from engine.events.log import RawEntry

__all__ = ["ARCHIVE_FORMAT", "ARCHIVE_VERSION", "Archive", "read_archive", "write_archive"]

ARCHIVE_FORMAT = "rollout-archive"
ARCHIVE_VERSION = 1


@dataclass(frozen=True, slots=True)
class Archive:
    stream: str
    rollout_id: str
    entries: list[RawEntry]


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


def read_archive(path: str | os.PathLike[str]) -> Archive:
    """Read an archive file; a file that is not one raises ``DecodeError`` naming it."""
    with open(path, "rb") as fh:
        values = msgpack.Unpacker(fh, raw=False, strict_map_key=True, max_buffer_size=2**31 - 1)
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
