"""The one launcher of the engine's processes: the demo, the trainer, the tests and the benches.

``Processes(logs, rollout=ROLLOUT, settings={...})`` starts named processes through the
``rollout`` command (``rollout`` is the Python arguments that run it, handed in by the top
layer: ``workers.cli.ROLLOUT``; the engine never imports ``workers``):

* ``start(name, command, *args)`` -- an engine process (``worker``, ``finalizer``, ``capture``,
  ``scheduler``, ``sync``): ``python <rollout> <command> <args>``;
* ``serve_tinylm(name, model_dir, *args)`` -- ``rollout tinylm serve`` on a reserved port,
  returned once it answers HTTP (``Process.url``); a restart serves on the same port.

Settings travel in the environment as their ``ROLLOUT_*`` variables (``engine.settings``),
checked here before anything starts; the Redis URL and every credential go there, never in
argv, which any local user can read in ``/proc/PID/cmdline``. A child gets none of this
process's ``ROLLOUT_*`` variables, only the ones given; a model server gets none at all.

Each process writes stdout and stderr to ``<logs>/<name>.log`` (appended across restarts);
``check_alive`` names a process that exited unasked and quotes the last lines of its log.
``stop`` (also on leaving the ``with`` block) sends SIGTERM to the engine's processes, then to
the model servers and ``rollout serve`` (so that the others' last calls still find a server),
waits ``grace_s`` and SIGKILLs what is left (its whole process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from engine.errors import BackendUnavailable, ConfigError, EngineError
from engine.ops.embedded import free_port
from engine.settings import Settings, env_name

__all__ = ["Process", "Processes", "settings_env"]

TAIL_LINES = 15


@dataclass
class Process:
    """One started process: what runs it again on ``restart``, and the running child."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)
    log: Path
    popen: subprocess.Popen[bytes] = field(repr=False)
    url: str = ""
    """A model server's URL (its port is kept across restarts); empty for the others."""
    stopped: bool = False
    """Stopped on request (``kill``, ``terminate``): not reported by ``check_alive``."""
    serves: bool = False
    """A model server or ``rollout serve``: stopped after the others."""

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = TAIL_LINES) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n  ".join(text.strip().splitlines()[-lines:])


def settings_env(settings: Mapping[str, object]) -> dict[str, str]:
    """``{"heartbeat_ms": 100}`` -> ``{"ROLLOUT_HEARTBEAT_MS": "100"}``; None unsets (empty
    value), a list is comma-joined. ``ConfigError`` for a name ``engine.settings`` lacks."""
    env: dict[str, str] = {}
    for name, value in settings.items():
        if name not in Settings.model_fields:
            raise ConfigError(f"{name!r} is not a setting (engine/settings.py)")
        if value is None:
            text = ""
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | tuple):
            text = ",".join(str(v) for v in value)
        else:
            text = str(value)
        env[env_name(name)] = text
    return env


class Processes:
    """Named processes started and stopped together; see the module docstring."""

    def __init__(
        self,
        logs: Path,
        *,
        rollout: Sequence[str],
        settings: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        grace_s: float = 20.0,
    ) -> None:
        self.logs = logs
        self.rollout = tuple(rollout)
        self.settings = dict(settings or {})
        self.grace_s = grace_s
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_")}
        self._env.update(env or {})
        self._procs: dict[str, Process] = {}
        logs.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        command: str,
        *args: str,
        settings: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        python: Sequence[str] = (),
    ) -> Process:
        """``python [python] <rollout> <command> <args>`` with the launcher's settings and
        ``settings`` in its environment; ``python``: interpreter arguments before the entry
        point (``-m cProfile -o FILE``)."""
        child = {**settings_env({**self.settings, **(settings or {})}), **(env or {})}
        try:
            Settings.from_env(child)  # what the child checks first, checked here at once
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        argv = [sys.executable, *python, *self.rollout, command, *args]
        return self.spawn(name, argv, child, serves=command == "serve")

    def serve_tinylm(
        self,
        name: str,
        model_dir: str | Path,
        *args: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float = 120.0,
    ) -> Process:
        """``rollout tinylm serve`` on ``port`` (default: a free one, reserved by binding it)
        as ``engine.ops.tinylm`` serves it (raw logprobs unless ``env`` says otherwise)."""
        port = free_port() if port is None else port
        argv = [sys.executable, *self.rollout, "tinylm", "serve", "--model", str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), *args]
        return self.spawn(name, argv, env, url=f"http://127.0.0.1:{port}", timeout_s=timeout_s)

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        url: str = "",
        timeout_s: float = 120.0,
        serves: bool = False,
    ) -> Process:
        """Run ``argv`` as ``name`` with ``env`` over the launcher's environment. With ``url``
        (a model server), return once it answers HTTP there; ``BackendUnavailable`` with its
        last log lines if it exits first or stays silent for ``timeout_s``. ``serves``: stopped
        after the others, as a server is."""
        held = self._procs.get(name)
        if held is not None and held.popen.poll() is None:
            raise EngineError(f"a process named {name!r} is running (pid {held.pid})")
        log = self.logs / f"{name}.log"
        child = {**self._env, **(env or {})}
        # A restart appends to the log of the run it replaces; the child holds its own copy
        # of the descriptor.
        with open(log, "ab" if held is not None else "wb") as out:
            popen = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT,
                                     env=child, start_new_session=True)
        proc = Process(name, tuple(argv), child, log, popen, url, serves=serves or bool(url))
        self._procs[name] = proc
        if url:
            self._wait_serving(proc, timeout_s)
        return proc

    def __getitem__(self, name: str) -> Process:
        try:
            return self._procs[name]
        except KeyError:
            raise KeyError(f"no process named {name!r}; started: {list(self._procs)}") from None

    def __iter__(self) -> Iterator[str]:
        """The names held, in start order, running or not."""
        return iter(list(self._procs))

    def alive(self, name: str) -> bool:
        return self[name].popen.poll() is None

    def check_alive(self) -> None:
        """``EngineError`` naming the first process that exited unasked, with its last lines."""
        for proc in self._procs.values():
            code = proc.popen.poll()
            if code is not None and not proc.stopped:
                raise EngineError(f"{proc.name} exited with status {code}; last lines of "
                                  f"{proc.log}:\n  {proc.tail()}")

    def output(self, name: str) -> str:
        """Everything ``name`` wrote to its log so far."""
        return self[name].log.read_text(errors="replace")

    def signal(self, name: str, sig: int) -> None:
        self[name].popen.send_signal(sig)

    def wait(self, name: str, timeout: float | None = None) -> int:
        """Its exit status once it exits; ``subprocess.TimeoutExpired`` after ``timeout``."""
        return self[name].popen.wait(timeout)

    def kill(self, name: str) -> int:
        """SIGKILL (the process only, not its group) and reap; returns the exit status."""
        proc = self[name]
        proc.stopped = True
        proc.popen.kill()
        return proc.popen.wait()

    def terminate(self, name: str, timeout: float | None = None) -> int:
        """SIGTERM, then wait (``timeout``, default the grace) and SIGKILL its group."""
        proc = self[name]
        proc.stopped = True
        self._stop([proc], self.grace_s if timeout is None else timeout)
        return proc.popen.returncode

    def restart(
        self, name: str, *, as_name: str | None = None, settings: Mapping[str, object] | None = None
    ) -> Process:
        """Run ``name``'s argv again (stopping it first if it runs), under ``as_name`` if
        given, with ``settings`` laid over its environment; a server keeps its port."""
        old = self[name]
        if old.popen.poll() is None:
            self.terminate(name)
        if as_name not in (None, name):
            del self._procs[name]
        return self.spawn(as_name or name, old.argv, {**old.env, **settings_env(settings or {})},
                          url=old.url, serves=old.serves)

    def stop(self) -> None:
        """SIGTERM the engine's processes, then the servers; SIGKILL what outlives the grace."""
        for servers in (False, True):
            procs = [p for p in self._procs.values() if p.serves is servers]
            for proc in procs:
                proc.stopped = True
            self._stop(procs, self.grace_s)
        self._procs.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @staticmethod
    def _stop(procs: Sequence[Process], grace_s: float) -> None:
        for proc in procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.popen.wait()

    @staticmethod
    def _wait_serving(proc: Process, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = proc.popen.poll()
            if code is not None:
                raise BackendUnavailable(f"{proc.name} ({proc.url}) exited with status {code} "
                                         f"before serving; last lines of {proc.log}:\n  "
                                         f"{proc.tail()}")
            try:
                if httpx.get(proc.url + "/get_model_info", timeout=2.0).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.popen.kill()
                proc.popen.wait()
                raise BackendUnavailable(f"{proc.name} did not answer at {proc.url} within "
                                         f"{timeout_s:.0f}s; last lines of {proc.log}:\n  "
                                         f"{proc.tail()}")
            time.sleep(0.1)
