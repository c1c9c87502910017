"""Stream and key names, built in one place.

Every key carries the configurable prefix (default ``rl``). Per-rollout streams wrap the
rollout id in a cluster hash tag (``rl:{rollout:<id>}``) so all keys of one rollout live on
one slot of a Redis Cluster; the shared streams each hash on their own name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.errors import ConfigError

_SAFE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _check(kind: str, value: str) -> str:
    if not value or not _SAFE.match(value):
        raise ConfigError(
            f"{kind} {value!r} may only contain letters, digits, '_', '.', '-' "
            "(it becomes part of a Redis key)"
        )
    return value


@dataclass(frozen=True, slots=True)
class StreamNames:
    """Builds every stream and key name from one prefix."""

    prefix: str = "rl"

    def __post_init__(self) -> None:
        _check("stream prefix", self.prefix)

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def pool(self) -> str:
        return f"{self.prefix}:pool"

    @property
    def capture(self) -> str:
        return f"{self.prefix}:capture"

    @property
    def data(self) -> str:
        return f"{self.prefix}:data"

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def dead_seen(self) -> str:
        """The set of ``stream@id`` already dead-lettered (one letter per entry)."""
        return f"{self.prefix}:dead:seen"

    def work(self, evaluator_id: str) -> str:
        return f"{self.prefix}:work:{{{_check('evaluator id', evaluator_id)}}}"

    def rollout(self, rollout_id: str) -> str:
        return f"{self.prefix}:{{rollout:{_check('rollout id', rollout_id)}}}"

    def counter(self, name: str) -> str:
        return f"{self.prefix}:counter:{_check('counter', name)}"

    def snapshot(self, name: str) -> str:
        return f"{self.prefix}:snapshot:{_check('snapshot', name)}"

    def rollout_id_of(self, stream: str) -> str | None:
        """Inverse of :meth:`rollout`: the rollout id of a per-rollout stream, else None."""
        head = f"{self.prefix}:{{rollout:"
        if stream.startswith(head) and stream.endswith("}"):
            return stream[len(head) : -1]
        return None
