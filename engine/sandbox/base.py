"""The sandbox port: where an agent's commands run, and how their ends are described.

Contract of every backend (checked by the contract suite in ``tests/sandbox``):

* ``provider.create(labels=..., limits=...)`` touches nothing; ``await sandbox.start()``
  allocates (a directory, a container). From then on the sandbox is findable by its labels:
  ``await provider.reap({"rollout.worker": wid})``, run by *another* worker, stops and removes
  every sandbox a crashed worker left behind and returns how many.
* ``exec`` runs one command in ``workdir``: a string under ``/bin/sh -c``, a sequence as the
  argv. The environment is the backend's base environment plus ``env``, never the worker's
  own (it holds credentials). The wall clock is ``timeout_s`` capped by
  ``limits.wall_timeout_s``; when it passes, every process the command started is killed.
* A command ended by the sandbox's limits is a result, not an exception: ``killed_by`` names
  the limit or signal, :func:`classify` gives an :class:`ExecOutcome`, and
  :func:`raise_for_outcome` raises for callers that want it. ``exec`` raises
  :class:`~engine.errors.SandboxError` only when the sandbox itself failed.
* ``stdout``/``stderr`` are UTF-8 (undecodable bytes replaced), each cut to the first
  ``limits.max_output_bytes`` bytes; the ``*_truncated`` flags say so.
* ``read_file``/``write_file`` take a path relative to ``workdir`` or absolute inside it; one
  that leaves it (``..``, an absolute path elsewhere, a symlink out) raises
  :class:`~engine.errors.SandboxEscape` naming the path. ``write_file`` creates parents.
* Network: commands reach nothing but the sandbox's own loopback (Docker: ``network_mode=none``;
  local: a network namespace per sandbox where the machine allows it, see
  ``LocalSandboxProvider.containment``). ``expose(Endpoint(port=..., target=...))`` makes one
  outside service reachable at ``127.0.0.1:port`` inside, relayed by the worker.
* ``stop`` kills every process of the sandbox and removes what it allocated; it is idempotent,
  and afterwards ``exec`` and the file calls raise ``SandboxError``.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from engine.errors import ConfigError, SandboxError, SandboxLimitExceeded, SandboxTimeout

__all__ = [
    "MANAGED_LABEL",
    "SANDBOX_ID_LABEL",
    "Endpoint",
    "ExecOutcome",
    "ExecResult",
    "KillReason",
    "Sandbox",
    "SandboxLimits",
    "SandboxProvider",
    "attribute_end",
    "classify",
    "command_argv",
    "evidence_of_limit",
    "raise_for_outcome",
    "sandbox_session",
    "signal_name",
    "validate_labels",
    "validate_selector",
]

MANAGED_LABEL = "rollout.sandbox"
"""Label every backend puts on its sandboxes (value ``"1"``); reap never touches others."""

SANDBOX_ID_LABEL = "rollout.sandbox.id"

_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


class KillReason(StrEnum):
    """Why the sandbox ended a command (``ExecResult.killed_by`` also holds signal names)."""

    TIMEOUT = "timeout"
    CPU = "cpu"
    MEMORY = "memory"
    PIDS = "pids"
    DISK = "disk"


class ExecOutcome(StrEnum):
    """One word for how a command ended, for summaries and abort diagnostics."""

    OK = "ok"
    NONZERO_EXIT = "nonzero_exit"
    TIMEOUT = "timeout"
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    PIDS_LIMIT = "pids_limit"
    DISK_LIMIT = "disk_limit"
    SIGNALED = "signaled"


_LIMIT_OUTCOMES: dict[str, ExecOutcome] = {
    KillReason.TIMEOUT: ExecOutcome.TIMEOUT,
    KillReason.CPU: ExecOutcome.CPU_LIMIT,
    KillReason.MEMORY: ExecOutcome.MEMORY_LIMIT,
    KillReason.PIDS: ExecOutcome.PIDS_LIMIT,
    KillReason.DISK: ExecOutcome.DISK_LIMIT,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxLimits:
    """Resource limits of one sandbox, validated on construction.

    ``cpu_time_s``: CPU seconds per process (``RLIMIT_CPU``, rounded up); ``memory_mb``:
    ``RLIMIT_DATA`` per process plus a memory cgroup locally, the container's limit under
    Docker; ``max_procs``: processes *and threads*; ``wall_timeout_s`` caps every ``exec``;
    ``max_output_bytes``: per stream and command; ``disk_mb``: ``RLIMIT_FSIZE`` per file
    locally, a tmpfs workdir under Docker; ``max_file_bytes``: per ``read_file``/``write_file``.
    """

    cpu_time_s: float = 60.0
    memory_mb: int = 1024
    max_procs: int = 256
    wall_timeout_s: float = 120.0
    max_output_bytes: int = 64 * 1024
    disk_mb: int | None = None
    max_file_bytes: int = 64 * 2**20

    def __post_init__(self) -> None:
        checks: list[tuple[str, float | None, float]] = [
            ("cpu_time_s", self.cpu_time_s, 0.0),
            ("memory_mb", self.memory_mb, 16.0),
            ("max_procs", self.max_procs, 1.0),
            ("wall_timeout_s", self.wall_timeout_s, 0.0),
            ("max_output_bytes", self.max_output_bytes, 0.0),
            ("disk_mb", self.disk_mb, 1.0),
            ("max_file_bytes", self.max_file_bytes, 0.0),
        ]
        for name, value, minimum in checks:
            if value is None:
                continue
            if isinstance(value, bool) or not math.isfinite(value) or value < minimum:
                raise ConfigError(
                    f"SandboxLimits.{name} must be a finite number >= {minimum:g}, got {value!r}"
                )
        if self.cpu_time_s == 0 or self.wall_timeout_s == 0:
            raise ConfigError(
                "SandboxLimits.cpu_time_s and wall_timeout_s must be > 0, got "
                f"{self.cpu_time_s!r} and {self.wall_timeout_s!r}"
            )

    @property
    def cpu_seconds(self) -> int:
        return max(1, math.ceil(self.cpu_time_s))

    def effective_timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.wall_timeout_s
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise SandboxError(f"exec timeout_s must be a positive number, got {timeout_s!r}")
        return min(timeout_s, self.wall_timeout_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecResult:
    """How one command ended.

    ``exit_code`` is ``128 + N`` when signal N ended the process. ``killed_by`` is ``None`` when
    the command ended on its own; else the :class:`KillReason` with the most specific evidence
    (a cgroup counter, an rlimit's signal, the runtime's out-of-memory or fork error; ``timeout``
    when only the wall clock ran out) or the killing signal's name (``"SIGSEGV"``).
    ``timed_out`` is true whenever the wall clock ran out.
    """

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    killed_by: str | None = None
    elapsed_s: float = 0.0
    diagnostics: Mapping[str, str] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_by is None and not self.timed_out


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """One service outside a sandbox that its commands may reach at ``127.0.0.1:port`` inside.

    ``target`` is ``"HOST:PORT"`` (TCP, connected to from the worker's network) or
    ``"unix:/path"`` (a Unix socket of the worker's machine).
    """

    port: int
    target: str

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not (
            1 <= self.port <= 65535
        ):
            raise ConfigError(f"Endpoint.port must be in 1..65535, got {self.port!r}")
        if self.unix_path is None:
            _ = self.host_port  # validates

    @property
    def unix_path(self) -> str | None:
        if self.target.startswith("unix:"):
            path = self.target[len("unix:") :]
            if not path.startswith("/"):
                raise ConfigError(
                    f"Endpoint.target {self.target!r}: the Unix path must be absolute"
                )
            return path
        return None

    @property
    def host_port(self) -> tuple[str, int]:
        host, sep, port = self.target.rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(
                f"Endpoint.target must be 'HOST:PORT' or 'unix:/path', got {self.target!r}"
            )
        return host.strip("[]"), int(port)


def classify(result: ExecResult) -> ExecOutcome:
    """Map a result to one :class:`ExecOutcome` (limits first, then signals, then exit code)."""
    if result.killed_by is not None:
        limit = _LIMIT_OUTCOMES.get(result.killed_by)
        if limit is not None:
            return limit
        return ExecOutcome.SIGNALED
    if result.timed_out:
        return ExecOutcome.TIMEOUT
    if result.exit_code != 0:
        return ExecOutcome.NONZERO_EXIT
    return ExecOutcome.OK


def raise_for_outcome(result: ExecResult, *, sandbox_id: str, command: str) -> ExecResult:
    """Raise ``SandboxTimeout``/``SandboxLimitExceeded`` for a limit outcome, else return it."""
    outcome = classify(result)
    where = f"command {command!r} in sandbox {sandbox_id}"
    if outcome is ExecOutcome.TIMEOUT:
        raise SandboxTimeout(f"{where} ran past its wall-clock limit ({result.elapsed_s:.1f}s)")
    if outcome in (
        ExecOutcome.CPU_LIMIT,
        ExecOutcome.MEMORY_LIMIT,
        ExecOutcome.PIDS_LIMIT,
        ExecOutcome.DISK_LIMIT,
    ):
        raise SandboxLimitExceeded(
            f"{where} hit its {result.killed_by} limit (exit code {result.exit_code})"
        )
    return result


def signal_name(signum: int) -> str:
    """``9 -> "SIGKILL"``; unknown numbers become ``"SIG<n>"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIG{signum}"


# Text the common runtimes print when an allocation or a fork is refused. Used only when no
# kernel counter is available; a command that prints these words on purpose is misclassified,
# which costs a diagnostic label, never containment.
_MEMORY_MARKERS = (
    "MemoryError",
    "Cannot allocate memory",
    "std::bad_alloc",
    "out of memory",
    "Out of memory",
)
_DISK_MARKERS = ("No space left on device", "Disk quota exceeded", "File too large")
_PIDS_MARKERS = (
    "Resource temporarily unavailable",
    "BlockingIOError",
    "can't fork",
    "fork: retry",
    "Cannot fork",
)


def evidence_of_limit(stderr: str) -> KillReason | None:
    """Which limit the error text of a failed command points at, if any (memory first)."""
    if any(marker in stderr for marker in _MEMORY_MARKERS):
        return KillReason.MEMORY
    if any(marker in stderr for marker in _PIDS_MARKERS):
        return KillReason.PIDS
    if any(marker in stderr for marker in _DISK_MARKERS):
        return KillReason.DISK
    return None


def attribute_end(
    exit_code: int,
    *,
    timed_out: bool,
    stderr: str,
    oom_killed: bool = False,
    pids_exhausted: bool = False,
) -> str | None:
    """``killed_by`` for a command that ended with ``exit_code``: the rlimit signals first,
    then the kernel's counters and the error text (for a failed command), the wall clock, the
    signal's name. A status above 128 counts as that signal even when a shell (or ``docker
    exec``) reported it for its child."""
    signum = exit_code - 128 if 128 < exit_code < 128 + 32 else None
    failed = timed_out or exit_code != 0
    if signum == signal.SIGXCPU:
        return KillReason.CPU
    if signum == signal.SIGXFSZ:
        return KillReason.DISK
    if failed and oom_killed:
        return KillReason.MEMORY
    if failed and pids_exhausted:
        return KillReason.PIDS
    if failed:
        evidence = evidence_of_limit(stderr)
        if evidence is not None:
            return evidence
    if timed_out:
        return KillReason.TIMEOUT
    if signum is not None:
        return signal_name(signum)
    return None


def command_argv(cmd: str | Sequence[str]) -> list[str]:
    """A string runs under ``/bin/sh -c``; a sequence is the argv itself (must be non-empty)."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise SandboxError("exec needs a command, got an empty string")
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(arg, str) for arg in argv):
        raise SandboxError(f"exec argv must be a non-empty list of strings, got {cmd!r}")
    if any("\0" in arg for arg in argv):
        raise SandboxError(f"exec argv must not contain NUL bytes, got {cmd!r}")
    return argv


def validate_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """Check label keys (``[A-Za-z0-9._/-]``, <= 128 chars) and values (no NUL or newline)."""
    checked: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY.match(key):
            raise SandboxError(
                f"sandbox label key {key!r} must match {_LABEL_KEY.pattern} "
                "(letters, digits, '.', '_', '/', '-')"
            )
        if not isinstance(value, str) or "\0" in value or "\n" in value or len(value) > 1024:
            raise SandboxError(
                f"sandbox label {key!r} needs a string value without NUL or newline "
                f"(<= 1024 chars), got {value!r}"
            )
        checked[key] = value
    return checked


def validate_selector(label_selector: Mapping[str, str]) -> dict[str, str]:
    """A reap selector: valid labels, and at least one (an empty one would reap everything)."""
    selector = validate_labels(label_selector)
    if not selector:
        raise SandboxError(
            "refusing to reap with an empty label selector: it matches every sandbox"
        )
    return selector


@runtime_checkable
class Sandbox(Protocol):
    """One isolated place to run an episode's commands."""

    @property
    def id(self) -> str: ...

    @property
    def labels(self) -> Mapping[str, str]: ...

    @property
    def limits(self) -> SandboxLimits: ...

    @property
    def workdir(self) -> str:
        """Absolute path of the working directory, as commands in the sandbox see it."""
        ...

    async def start(self) -> None: ...

    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
    ) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None: ...

    async def expose(self, endpoint: Endpoint) -> str:
        """Make ``endpoint.target`` reachable at ``127.0.0.1:endpoint.port`` inside and return
        that address; ``SandboxError`` when the sandbox has no network of its own."""
        ...

    async def stop(self) -> None: ...


@runtime_checkable
class SandboxProvider(Protocol):
    """Makes sandboxes of one backend and reaps them by label."""

    def create(self, *, labels: Mapping[str, str], limits: SandboxLimits | None = None) -> Sandbox:
        """A new, not yet started sandbox carrying ``labels`` (``None``: provider defaults)."""
        ...

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        """Stop and remove every sandbox carrying all of ``label_selector``; return the count."""
        ...


@asynccontextmanager
async def sandbox_session(
    provider: SandboxProvider,
    *,
    labels: Mapping[str, str],
    limits: SandboxLimits | None = None,
) -> AsyncIterator[Sandbox]:
    """Create and start a sandbox, and stop it however the block ends."""
    sandbox = provider.create(labels=labels, limits=limits)
    try:
        await sandbox.start()
        yield sandbox
    finally:
        await sandbox.stop()
