"""Stream and key names, built in one place.

Every key carries the prefix (default ``rl``) and a Redis Cluster hash tag (the part in
braces, which alone decides a key's slot):

* the control plane (control, pool, data, work streams, capture, dead letters, markers,
  counters, snapshots) shares ``{<prefix>}`` (``rl:{rl}:work:math``), so every
  exactly-once step among them (admission: ``TokenAcquired`` with ``BatchAdmitted``) is
  one single-slot script;
* each rollout's stream is tagged by its id (``rl:{rollout:<id>}``), so rollouts spread
  over the slots; a step touching it and the control plane is split into idempotent steps.
"""

from __future__ import annotations

import re
from binascii import crc_hqx
from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import ConfigError, LogError

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _check(kind: str, value: str) -> str:
    if not value or not _SAFE.match(value):
        raise ConfigError(
            f"{kind} {value!r} may only contain letters, digits, '_', '.', '-' "
            "(it becomes part of a Redis key)"
        )
    return value


CLUSTER_SLOTS = 16384


def key_slot(key: str) -> int:
    """The Redis Cluster slot of ``key``: CRC16 of its hash tag (the first non-empty
    ``{...}``), else of the whole key."""
    raw = key.encode()
    start = raw.find(b"{")
    if start > -1:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return crc_hqx(raw, 0) % CLUSTER_SLOTS


def check_one_slot(what: str, keys: Sequence[str]) -> None:
    """Refuse an atomic step over keys of several cluster slots, on any store, so a
    test on one Redis or in memory catches what a cluster would refuse."""
    slots = {key: key_slot(key) for key in keys}
    if len(set(slots.values())) > 1:
        listed = ", ".join(f"{key} (slot {slot})" for key, slot in slots.items())
        raise LogError(
            f"{what}: one atomic step may only touch keys of one cluster slot, got {listed}; "
            f"give the keys one hash tag (engine.events.names) or split the step"
        )


@dataclass(frozen=True, slots=True)
class StreamNames:
    """Builds every stream and key name from one prefix."""

    prefix: str = "rl"

    def __post_init__(self) -> None:
        _check("stream prefix", self.prefix)

    @property
    def control(self) -> str:
        return f"{self.plane}:control"

    @property
    def pool(self) -> str:
        return f"{self.plane}:pool"

    @property
    def capture(self) -> str:
        return f"{self.plane}:capture"

    @property
    def data(self) -> str:
        return f"{self.plane}:data"

    @property
    def dead(self) -> str:
        return f"{self.plane}:dead"

    @property
    def dead_seen(self) -> str:
        """The set of ``stream@id`` already dead-lettered (one letter per entry)."""
        return f"{self.plane}:dead:seen"

    @property
    def plane(self) -> str:
        """The head every control-plane key starts with: ``<prefix>:{<prefix>}``."""
        return f"{self.prefix}:{{{self.prefix}}}"

    @property
    def work_pattern(self) -> str:
        return f"{self.plane}:work:*"

    @property
    def rollout_pattern(self) -> str:
        return f"{self.prefix}:{{rollout:*}}"

    def work(self, evaluator_id: str) -> str:
        return f"{self.plane}:work:{_check('evaluator id', evaluator_id)}"

    def rollout(self, rollout_id: str) -> str:
        return f"{self.prefix}:{{rollout:{_check('rollout id', rollout_id)}}}"

    def once(self, name: str) -> str:
        """The marker of a step done once (``EventLog.append_once``); on the control plane."""
        return f"{self.plane}:once:{_check('once marker', name)}"

    def counter(self, name: str) -> str:
        return f"{self.plane}:counter:{_check('counter', name)}"

    def snapshot(self, name: str) -> str:
        return f"{self.plane}:snapshot:{_check('snapshot', name)}"

    def rollout_id_of(self, stream: str) -> str | None:
        """Inverse of :meth:`rollout`: the rollout id of a per-rollout stream, else None."""
        head = f"{self.prefix}:{{rollout:"
        if stream.startswith(head) and stream.endswith("}"):
            return stream[len(head) : -1]
        return None
