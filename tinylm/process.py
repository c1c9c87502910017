"""Run a tinylm server as a subprocess and find out where it listens.

``spawn_server(model_dir)`` starts ``python -m tinylm serve --model DIR --port 0``,
reads its stdout until the ready line (``tinylm ready on http://HOST:PORT ...``) and returns a
``ServerProcess`` with the URL. Both output streams keep being drained by daemon threads (a full
pipe would otherwise stall the server); the last lines are kept for error messages.
``close()`` sends SIGTERM (the server aborts in-flight requests and answers them) and kills the
process if it has not exited within the grace period.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from tinylm.errors import ServerUnavailable
from tinylm.server import READY_PREFIX

__all__ = ["ServerProcess", "spawn_server"]


class ServerProcess:
    """A tinylm server subprocess that has printed its ready line."""

    def __init__(
        self, process: subprocess.Popen[str], url: str, tail: collections.deque[str]
    ) -> None:
        self.process = process
        self.url = url
        self._tail = tail

    @property
    def output_tail(self) -> str:
        return "".join(self._tail)

    def close(self, grace_s: float = 10.0) -> int:
        """Stop the server; returns its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drain(stream: IO[str], tail: collections.deque[str]) -> None:
    for line in stream:
        tail.append(line)


def spawn_server(
    model_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    extra_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
    env: Mapping[str, str | None] | None = None,
) -> ServerProcess:
    """Start ``rollout tinylm serve`` in a subprocess; ``ServerUnavailable`` if never ready.

    ``env`` is laid over this process's environment; a ``None`` value removes the variable
    (e.g. ``{"SGLANG_RETURN_ORIGINAL_LOGPROB": None}`` for SGLang's default logprobs)."""
    environ = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    cmd = [
        sys.executable,
        "-m",
        "tinylm",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        *extra_args,
    ]
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=environ,
    )
    assert process.stdout is not None
    tail: collections.deque[str] = collections.deque(maxlen=50)
    found: list[str] = []
    ready = threading.Event()

    def watch() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line)
            if line.startswith(READY_PREFIX) and not found:
                found.append(line[len(READY_PREFIX) :].split()[0])
                ready.set()
                break
        ready.set()
        _drain(process.stdout, tail)

    threading.Thread(target=watch, name="tinylm-stdout", daemon=True).start()
    if not ready.wait(startup_timeout_s) or not found:
        process.kill()
        process.wait()
        raise ServerUnavailable(
            f"tinylm server for {model_dir} did not print its ready line within "
            f"{startup_timeout_s:.0f}s (exit status {process.returncode}); output:\n"
            + "".join(tail)
        )
    return ServerProcess(process, found[0], tail)
