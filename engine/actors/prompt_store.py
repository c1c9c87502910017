"""``PromptStore``: a group's prompt tokens stored once per rollout.

With the worker's store, prompt tokens are stored once per rollout and prompt
(``PromptStored``, emitted before the first sample that refers to it) and each
``SampleCompleted`` carries only its ``prompt_key``: the n samples of a group share one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.events.arrays import TokenIds
from engine.events.catalog import PromptStored

__all__ = ["PromptStore"]


class PromptStore:
    """Which prompts this process has stored (``PromptStored``) per rollout, so a group's
    n samples carry a reference to one copy instead of n.

    A prompt is marked stored when its event is emitted: the sink writes in emit order and
    keeps failed writes at the head of its queue, so the ``PromptStored`` is in the log
    before any event that refers to it. Another process keeps its own marks and may store
    the same prompt again; the fold keeps the first. Prompts of at most ``inline_bytes``
    bytes stay inline (a reference would not be smaller). The marks are bounded
    (``max_keys``, oldest forgotten first: a forgotten prompt is just stored again).
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
