"""``BatchTokens``: a batch's placement tokens (``BatchAdmitted.token_ids``), one per
running sample.

A sample takes one (waiting for a free one) before its ``run`` phase and gives it back
after ``cleanup``. Tokens no remaining sample can use (more than ``min(unfinished,
concurrency)``) go back to the pool at once, the rest when the batch ends; a batch without
tokens runs ungated. Tokens freed in one event-loop tick leave in one ``TokenReleased`` at
its end, after those samples' terminal events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

__all__ = ["BatchTokens", "Release"]

Release = Callable[[list[str], str], None]
"""Emits the ``TokenReleased`` of ``(token ids, reason)``."""


class BatchTokens:
    def __init__(
        self, tokens: Sequence[str], *, samples: int, concurrency: int, release: Release
    ) -> None:
        self.gated = bool(tokens)
        self._held: set[str] = set(tokens)
        self._free: asyncio.Queue[str] = asyncio.Queue()
        for token in tokens:
            self._free.put_nowait(token)
        self._unfinished = samples
        self._concurrency = concurrency
        self._emit_release = release
        self._releasing: list[str] = []
        self._release_scheduled = False

    async def take(self) -> str | None:
        """A free token (waiting for one); None when the batch runs ungated."""
        if not self.gated:
            return None
        return await self._free.get()

    def give_back(self, token: str | None) -> None:
        """A sample ended, holding ``token`` (None: it took none)."""
        self._unfinished -= 1
        if token is not None:
            self._free.put_nowait(token)
        if self.gated:
            self.release_surplus("sample_done")

    def release_surplus(self, reason: str) -> None:
        """Release, at the end of this tick, free tokens the unfinished samples cannot use."""
        needed = min(self._unfinished, self._concurrency)
        while len(self._held) > needed and not self._free.empty():
            token = self._free.get_nowait()
            self._held.discard(token)
            self._releasing.append(token)
        if self._releasing and not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self.release_now, reason)

    def release_now(self, reason: str) -> None:
        self._release_scheduled = False
        tokens, self._releasing = self._releasing, []
        if tokens:
            self.release(tokens, reason)

    def release_rest(self) -> None:
        """The batch is done: release every token still held."""
        self.release_now("sample_done")
        if self._held:
            self.release(sorted(self._held), "batch_done")

    def release(self, token_ids: list[str], reason: str) -> None:
        for token in token_ids:
            self._held.discard(token)
        self._emit_release(token_ids, reason)
