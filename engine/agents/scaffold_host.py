"""What runs around an installed scaffold on the worker: its process and its command bridge.

- ``run_scaffold`` runs the scaffold in its own process group with a clean environment (never
  the worker's: it holds credentials), its output in ``scaffold.log`` of its run folder, and
  kills the whole group on its wall clock, on cancellation or on any error;
- ``CommandBridge`` serves the scaffold's commands over a Unix socket and runs each one in the
  episode's sandbox (``Sandbox.exec``);
- ``check_command`` runs a scaffold's check or install command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from engine.errors import SandboxError
from engine.sandbox import Sandbox

__all__ = ["CommandBridge", "base_env", "check_command", "run_scaffold"]

log = logging.getLogger(__name__)

_LOG_TAIL = 4000


class CommandBridge:
    """Runs the scaffold's commands in the sandbox: a Unix socket in a private (0700) folder.

    One connection per command: a JSON line ``{"command", "timeout", "env"}`` in, a JSON line
    ``{"output", "returncode", "exception_info"}`` out. A command that fails in the sandbox is
    an answer; a sandbox that fails is answered with ``returncode -1`` and recorded in
    ``sandbox_failures``, so the episode can say the sandbox, not the model, failed.
    """

    def __init__(self, sandbox: Sandbox, *, command_timeout_s: float) -> None:
        self.sandbox = sandbox
        self.command_timeout_s = command_timeout_s
        self.commands = 0
        self.sandbox_failures: list[str] = []
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None

    @property
    def address(self) -> str:
        if self._dir is None:
            raise RuntimeError("the command bridge is not started")
        return f"unix:{self._dir}/bridge.sock"

    async def __aenter__(self) -> CommandBridge:
        # A short path of its own: Unix socket paths are limited to ~107 bytes.
        self._dir = tempfile.mkdtemp(prefix="rl-bridge-")
        self._server = await asyncio.start_unix_server(
            self._serve, path=f"{self._dir}/bridge.sock", limit=2**22
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await reader.readline()
            reply = await self._run(line)
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except Exception as exc:  # a broken connection must not take the episode down
            log.warning("command bridge: %r", exc)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _run(self, line: bytes) -> dict[str, Any]:
        try:
            request = json.loads(line)
            command = request["command"]
            if not isinstance(command, str):
                raise TypeError("command must be a string")
        except (ValueError, KeyError, TypeError) as exc:
            return {"output": "", "returncode": -1, "exception_info": f"bad request: {exc}"}
        timeout = request.get("timeout")
        timeout_s = min(float(timeout), self.command_timeout_s) if timeout else None
        env = request.get("env") if isinstance(request.get("env"), dict) else None
        self.commands += 1
        try:
            result = await self.sandbox.exec(
                command,
                timeout_s=timeout_s or self.command_timeout_s,
                env={str(k): str(v) for k, v in (env or {}).items()},
            )
        except SandboxError as exc:
            self.sandbox_failures.append(f"{type(exc).__name__}: {exc}")
            return {"output": "", "returncode": -1, "exception_info": f"sandbox error: {exc}"}
        info = ""
        if result.timed_out:
            info = f"the command timed out after {result.elapsed_s:.0f}s and was killed"
        elif result.killed_by is not None:
            info = f"the command was killed ({result.killed_by})"
        return {
            "output": result.stdout + result.stderr,
            "returncode": result.exit_code,
            "exception_info": info,
        }


async def check_command(argv: Sequence[str]) -> str | None:
    """Run ``argv``; ``None`` when it exits 0, else what went wrong."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=base_env(None),
        )
        _, err = await proc.communicate()
    except OSError as exc:
        return f"{' '.join(argv)} cannot run: {exc}"
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-300:].strip()
        return f"{' '.join(argv)} exited {proc.returncode}: {tail}"
    return None


def base_env(run_dir: Path | None) -> dict[str, str]:
    """A clean environment for the scaffold: never the worker's own (credentials)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    if run_dir is not None:
        home = run_dir / "home"
        home.mkdir(exist_ok=True)
        env["HOME"] = str(home)
    else:
        env["HOME"] = tempfile.gettempdir()
    return env


async def run_scaffold(
    argv: Any, *, env: Mapping[str, str], cwd: Path, timeout_s: float
) -> tuple[int | None, bool, str]:
    """Run the scaffold in its own process group; ``(exit code, timed out, log tail)``."""
    log_path = cwd / "scaffold.log"
    with open(log_path, "wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=str(cwd),
            env=dict(env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    timed_out = False
    try:
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
    finally:
        # The whole group goes, also what an exited scaffold left behind in it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None or timed_out:
            with contextlib.suppress(Exception):
                await asyncio.shield(proc.wait())
    tail = log_path.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
    return (None if timed_out else proc.returncode), timed_out, tail
