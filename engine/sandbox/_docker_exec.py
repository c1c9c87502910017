"""One ``docker exec`` of a Docker sandbox: environment, captured output, kill, end.

Each exec carries an environment marker (``ROLLOUT_SANDBOX_EXEC=<sandbox id>/<n>``); on
timeout a second exec kills every process in the container carrying it (the image needs
``/bin/sh``, ``tr`` and ``grep``). An unrequested SIGKILL (exit 137) is ``memory`` when the
daemon reported an ``oom`` event for the container during the exec (concurrent execs in one
sandbox can be confused), otherwise ``SIGKILL``.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import SandboxError
from engine.sandbox._docker_api import translate
from engine.sandbox.base import ExecResult, attribute_end

__all__ = ["EXEC_MARKER", "Output", "environment", "exit_code", "kill_exec", "result", "stdin_argv"]

EXEC_MARKER = "ROLLOUT_SANDBOX_EXEC"

# Kills every process whose environment holds the marker given as $1, until none is left.
# The pipeline's own processes do not carry the marker (it is an argument here, not env).
_KILLER = r"""
m="$1"; round=0
while [ "$round" -lt 100 ]; do
  found=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    [ "$p" = "$$" ] && continue
    if tr '\000' '\n' < "$d/environ" 2>/dev/null | grep -qxF -- "$m"; then
      kill -9 "$p" 2>/dev/null && found=1
    fi
  done
  [ "$found" = 0 ] && exit 0
  round=$((round + 1))
done
exit 1
"""

_KILLED = 128 + signal.SIGKILL


class Output:
    """Thread-safe capture of one exec's two streams, keeping the first ``limit`` bytes each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = (bytearray(), bytearray())
        self.truncated = [False, False]
        self.lock = threading.Lock()

    def add(self, index: int, chunk: bytes) -> None:
        with self.lock:
            buffer = self.data[index]
            room = self.limit - len(buffer)
            if room > 0:
                buffer += chunk[:room]
            if len(chunk) > room:
                self.truncated[index] = True

    def text(self, index: int) -> str:
        with self.lock:
            return self.data[index].decode("utf-8", "replace")


def environment(
    base: Mapping[str, str],
    env: Mapping[str, str] | None,
    *,
    home: str,
    marker: str,
    sandbox_id: str,
) -> dict[str, str]:
    out = dict(base)
    out["HOME"] = home
    for key, value in (env or {}).items():
        if not key or "=" in key or "\0" in key or "\0" in value or key == EXEC_MARKER:
            raise SandboxError(f"exec in sandbox {sandbox_id}: environment name {key!r} invalid")
        out[key] = value
    out[EXEC_MARKER] = marker
    return out


def stdin_argv(path: str, argv: list[str]) -> list[str]:
    """``argv`` run with stdin from the file ``path``, which the shell unlinks first."""
    script = 'exec <"$0" || exit 125; rm -f -- "$0" 2>/dev/null; exec "$@"'
    return ["/bin/sh", "-c", script, path, *argv]


async def kill_exec(container: Any, marker: str, *, user: str, grace_s: float) -> bool:
    """Kill every process of one exec from inside the container; False if that failed."""

    def run() -> int:
        command = ["/bin/sh", "-c", _KILLER, "rollout-kill", f"{EXEC_MARKER}={marker}"]
        return int(container.exec_run(command, user=user).exit_code)

    try:
        code = await asyncio.wait_for(asyncio.to_thread(run), grace_s)
    except Exception:
        return False
    return code == 0


async def exit_code(
    api: Any, exec_id: str, *, timed_out: bool, failed: Callable[[], bool], sandbox_id: str
) -> int:
    """The exec's exit code; SIGKILL's when it was killed or the sandbox failed."""
    for _ in range(100):
        try:
            info = await asyncio.to_thread(api.exec_inspect, exec_id)
        except Exception as exc:
            if failed():
                return _KILLED
            raise translate(f"sandbox {sandbox_id}: inspecting an exec", exc) from exc
        if not info.get("Running") and info.get("ExitCode") is not None:
            return int(info["ExitCode"])
        if timed_out or failed():
            return _KILLED
        await asyncio.sleep(0.02)
    return _KILLED


async def _oom_killed_between(
    client: Any, container_id: str, since: float, until: float
) -> bool | None:
    """Whether the daemon reported an ``oom`` event for the container in ``[since, until]``;
    ``None`` when the events cannot be read."""

    def run() -> list[Any]:
        filters = {"container": container_id, "event": "oom"}
        return list(client.api.events(since=since, until=until, filters=filters, decode=True))

    try:
        events = await asyncio.to_thread(run)
    except Exception:
        return None
    return bool(events)


async def result(
    code: int,
    output: Output,
    *,
    timed_out: bool,
    elapsed: float,
    since: float,
    client: Any,
    container_id: str,
    failure: str | None,
) -> ExecResult:
    """The exec's result; ``failure`` is why the sandbox failed during it, if it did."""
    stderr = output.text(1)
    diagnostics: dict[str, str] = {}
    oom_killed = False
    if code == _KILLED and not timed_out:
        oom = await _oom_killed_between(client, container_id, since, time.time())
        if oom is not None:
            diagnostics["docker_oom_event"] = str(oom).lower()
            oom_killed = oom
    killed_by = attribute_end(code, timed_out=timed_out, stderr=stderr, oom_killed=oom_killed)
    if failure is not None:
        diagnostics["sandbox_failed"] = failure
    return ExecResult(
        exit_code=code,
        stdout=output.text(0),
        stderr=stderr,
        stdout_truncated=output.truncated[0],
        stderr_truncated=output.truncated[1],
        timed_out=timed_out,
        killed_by=killed_by,
        elapsed_s=elapsed,
        diagnostics=diagnostics,
    )
