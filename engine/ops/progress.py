"""Progress bars for the operator tools: rich on a terminal, plain lines elsewhere.

Without a terminal a :class:`Bar` prints a line only when it changed, at most one every
``every_s`` seconds but for the final state, so a log never fills with repeats.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

__all__ = ["Bar"]


class Bar:
    """``update(done, total, note)`` as often as wanted, then ``close()``. ``console``
    decides the mode (``is_terminal``); ``file`` and ``clock`` serve the plain mode."""

    def __init__(
        self,
        label: str,
        *,
        console: Console | None = None,
        file: IO[str] | None = None,
        every_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label = label
        self._console = console or Console()
        self._file = file
        self._every_s = every_s
        self._clock = clock
        self._last_line: str | None = None
        self._last_at: float | None = None
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("{task.description:<9}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("left"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[note]}"),
                console=self._console,
            )
            self._task = self._progress.add_task(label, total=None, note="")
            self._progress.start()

    def update(self, done: int, total: int | None, note: str = "") -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total, note=note)
            return
        line = f"{self.label:<9} {done}/{total if total is not None else '?'}"
        if note:
            line += f"  {note}"
        now = self._clock()
        final = total is not None and done >= total
        if line == self._last_line:
            return
        if not final and self._last_at is not None and now - self._last_at < self._every_s:
            return
        self._last_line, self._last_at = line, now
        print(line, file=self._file, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
