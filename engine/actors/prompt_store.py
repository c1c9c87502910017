"""``PromptStore``: a group's prompt tokens stored once per rollout (``PromptStored``), each
``SampleCompleted`` carrying only its ``prompt_key``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.events.arrays import TokenIds
from engine.events.catalog import PromptStored

__all__ = ["PromptStore"]


class PromptStore:
    """Which prompts this process has stored per rollout.

    A prompt is marked stored when its event is emitted: the sink writes in emit order, so
    the ``PromptStored`` precedes every event that refers to it. Another process may store
    the same prompt again; the fold keeps the first. Prompts of at most ``inline_bytes``
    stay inline (a reference would not be smaller); at most ``max_keys`` marks are kept,
    the oldest forgotten first (a forgotten prompt is stored again).
    """

    def __init__(self, *, inline_bytes: int = 64, max_keys: int = 65_536) -> None:
        self.inline_bytes = inline_bytes
        self.max_keys = max_keys
        self._stored: OrderedDict[tuple[str, str], None] = OrderedDict()

    def refer(self, rollout_id: str, prompt_ids: TokenIds) -> tuple[str, PromptStored | None]:
        """``(prompt_key, event to emit first or None)``; ``("", None)``: keep it inline."""
        data = prompt_ids.data
        if len(data) <= self.inline_bytes:
            return "", None
        key = hashlib.blake2b(data, digest_size=12).hexdigest()
        mark = (rollout_id, key)
        if mark in self._stored:
            self._stored.move_to_end(mark)
            return key, None
        self._stored[mark] = None
        while len(self._stored) > self.max_keys:
            self._stored.popitem(last=False)
        return key, PromptStored(rollout_id=rollout_id, prompt_key=key, prompt_ids=prompt_ids)
