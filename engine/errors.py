"""The engine's one exception tree.

Adapters translate third-party exceptions (redis, httpx, docker, OS) at the boundary
(``raise BackendUnavailable(...) from exc``) so callers only ever catch these names.
A message names the thing at fault: the file and line, the dataset and field, the
evaluator id, the URL, what was expected and what was found.

::

    EngineError
    ├── ConfigError                 bad settings, YAML, layout, evaluator config, dataset line
    ├── EventError
    │   ├── DecodeError             bytes that are not a valid event (goes to the dead letters)
    │   ├── UnknownEventType
    │   └── SchemaVersionError      written by a newer engine than this one
    ├── LogError
    │   ├── LogUnavailable          Redis could not be reached / answered with an error
    │   └── AppendConflict          compare-and-append lost the race (carries current last id)
    ├── OutageExceeded              Redis unreachable past the outage limit (fatal: not a LogError,
    │                               so nothing that rides out log errors swallows it)
    ├── PlacementError
    │   └── DeadlockError           a spec needs more tokens than the pool can ever give
    ├── BackendError
    │   ├── BackendUnavailable      connection refused, DNS, timeouts
    │   │   ├── ServerStalled       a streamed generation made no progress for stall_s
    │   │   └── ReplyCutOff         the connection closed before the reply was whole (also a
    │   │                           BackendProtocolError)
    │   ├── ServersDown             every policy server stayed down past the outage limit
    │   ├── BackendHTTPError        a non-2xx answer (carries URL and status)
    │   ├── BackendProtocolError    a reply that does not have the documented shape
    │   └── GenerationAborted       the server aborted the request
    ├── SandboxError
    │   ├── SandboxTimeout
    │   ├── SandboxLimitExceeded    CPU, memory or process-count limit hit
    │   └── SandboxEscape           a path resolves outside the sandbox
    ├── AgentError
    │   └── EpisodeTimeout          the per-sample episode window elapsed
    └── RolloutError
        ├── RolloutFailed           the engine gave up on a rollout (carries the reason)
        └── WeightSyncFailed        a weight sync failed: the engine is poisoned until a later
                                    sync succeeds (carries the original error)
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class ConfigError(EngineError):
    """Invalid configuration or input data; the message names the source and the key."""


class EventError(EngineError):
    """An event could not be encoded, decoded or validated."""


class DecodeError(EventError):
    """Raw bytes from a stream are not a valid event."""


class UnknownEventType(DecodeError):
    """The ``type`` field names no registered event class."""


class SchemaVersionError(DecodeError):
    """The event was written with a schema version this engine does not know."""


class LogError(EngineError):
    """The event log (Redis Streams) failed."""


class LogUnavailable(LogError):
    """Redis could not be reached or refused a command."""


class OutageExceeded(EngineError):
    """Redis stayed unreachable longer than the configured outage limit: the process gives
    up (exits) instead of retrying forever. Never retried by the runtime."""


class AppendConflict(LogError):
    """Compare-and-append found another writer's entry after the expected position."""

    def __init__(self, stream: str, expected: str, current: str) -> None:
        super().__init__(
            f"compare-and-append on {stream!r} lost the race: expected last id {expected}, "
            f"stream is at {current}"
        )
        self.stream = stream
        self.expected = expected
        self.current = current


class PlacementError(EngineError):
    """The placement pool cannot satisfy a request as asked."""


class DeadlockError(PlacementError):
    """A spec needs more placement tokens than the pool can ever provide."""


class BackendError(EngineError):
    """A model backend failed."""


class BackendUnavailable(BackendError):
    """The model server could not be reached (refused, reset, timed out)."""


class ServerStalled(BackendUnavailable):
    """A streamed generation received nothing for ``stall_s`` and the server failed its
    health check: the call was given up (and its request aborted on the server)."""


class BackendProtocolError(BackendError):
    """The model server's reply does not have the documented shape."""


class ReplyCutOff(BackendUnavailable, BackendProtocolError):
    """The server closed the connection before its reply was whole (it died, or the
    connection was reset): a malformed reply to its reader, a lost connection to a retry."""


class ServersDown(BackendError):
    """Every policy server of a worker stayed down longer than the outage limit; the
    rollouts waiting for one fail (not retried: no server is left to retry on)."""


class BackendHTTPError(BackendError):
    """The model server answered with a non-success status."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} answered HTTP {status}: {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


class GenerationAborted(BackendError):
    """The server aborted the generation request."""


class SandboxError(EngineError):
    """A sandbox operation failed."""


class SandboxTimeout(SandboxError):
    """A command in the sandbox ran past its wall-clock limit."""


class SandboxLimitExceeded(SandboxError):
    """A command hit a CPU, memory or process-count limit."""


class SandboxEscape(SandboxError):
    """A path given to the sandbox resolves outside its directory."""


class AgentError(EngineError):
    """An agent could not run its episode."""


class EpisodeTimeout(AgentError):
    """The per-sample episode window elapsed."""


class RolloutError(EngineError):
    """A rollout could not be produced."""


class RolloutFailed(RolloutError):
    """The engine gave up on a rollout; ``reason`` says why."""

    def __init__(self, rollout_id: str, reason: str) -> None:
        super().__init__(f"rollout {rollout_id} failed: {reason}")
        self.rollout_id = rollout_id
        self.reason = reason


class WeightSyncFailed(RolloutError):
    """A weight sync failed and the engine is poisoned: nothing generates until a later
    sync succeeds. ``error`` is the sync's original error text, per failed server."""

    def __init__(
        self, version: int, error: str, servers_failed: list[str] | None = None
    ) -> None:
        super().__init__(f"weight sync to policy version {version} failed: {error}")
        self.version = version
        self.error = error
        self.servers_failed = list(servers_failed or [])
