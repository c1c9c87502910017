"""Archive a rollout's stream to a file (format: :mod:`engine.runtime.archive`) and replay
a rollout from the log or an archive.

Replay folds the stream up to and including the first ``RolloutReady`` (the state the live
finalizer wrote from) and writes the artifacts with the finalizer's own
:func:`engine.actors.artifacts.write_artifacts`, so the files are byte-identical.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from engine.actors.artifacts import write_artifacts
from engine.errors import DecodeError, RolloutError
from engine.events.base import Envelope
from engine.events.catalog import RolloutReady
from engine.events.codec import decode
from engine.events.log import EventLog, RawEntry
from engine.projections.base import fold, start
from engine.projections.readback import Rollout, in_memory
from engine.projections.rollout import RolloutProjection
from engine.runtime.archive import ARCHIVE_FORMAT, Archive, read_archive, write_archive

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


async def raw_entries(log: EventLog, stream: str, *, page: int = 2000) -> list[RawEntry]:
    return await log.read_raw(stream, page=page)


async def archive_rollout(log: EventLog, rollout_id: str, path: str | os.PathLike[str]) -> int:
    """Archive every event of the rollout's stream to ``path``; returns the count."""
    stream = log.names.rollout(rollout_id)
    entries = await raw_entries(log, stream)
    if not entries:
        raise RolloutError(f"rollout {rollout_id}: stream {stream} is empty or missing")
    return write_archive(path, Archive(stream, rollout_id, entries))


def decode_entries(stream: str, entries: Iterable[RawEntry]) -> tuple[list[Envelope], int]:
    """The envelopes of the entries, and how many did not decode."""
    out: list[Envelope] = []
    bad = 0
    for entry_id, raw in entries:
        try:
            out.append(Envelope(stream, entry_id, decode(raw)))
        except DecodeError:
            bad += 1
    return out, bad


def replay_state(envelopes: Iterable[Envelope]) -> Rollout:
    """Fold a rollout stream up to and including its first ``RolloutReady``, with the
    stream's entries at hand for building its samples."""
    envs = list(envelopes)
    until = next((e.id for e in envs if isinstance(e.event, RolloutReady)), None)
    projection = RolloutProjection()
    return in_memory(fold(projection, start(projection), envs, until=until).state, envs)


def replay_to_dir(rollout: Rollout, out_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write the artifacts of a replayed rollout; ``RolloutError`` if it is not ready."""
    state = rollout.state
    if state.ready is None:
        raise RolloutError(
            f"rollout {state.rollout_id} has no RolloutReady: nothing to replay yet "
            f"({state.n_terminal} of {len(state.samples)} samples terminal)"
        )
    return write_artifacts(rollout, out_dir)
