"""The ``EpisodeContext`` of one attempt, and its private temporary directory.

A ``BatchRun`` builds one context per attempt (``attempt_context``) on the hot path, so it
skips what ``EpisodeContext(...)`` would repeat per field, and copies it once more when the
attempt's placement token names a node (``with_node``). The attempt's ``tmp_dir`` is a path
inside the batch's directory, reserved when the episode first reads it (``LazyTmp``); the
batch run removes both the attempt's and the batch's directory when they are done.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from engine.agents.base import EpisodeContext

__all__ = ["AttemptContext", "LazyTmp", "attempt_context", "remove_dir", "with_node"]


def with_node(ctx: EpisodeContext, node: str) -> EpisodeContext:
    """``dataclasses.replace(ctx, node=node)`` without re-running ``__post_init__`` (every
    other field was checked when ``ctx`` was built): a per-sample copy on the hot path."""
    copy = _new(type(ctx))
    copy.__dict__.update(ctx.__dict__)
    _set(copy, "node", node)
    return copy


class LazyTmp:
    """An attempt's ``tmp_dir``: a path reserved (not created) inside the batch's directory
    when the episode first reads it. Neither exists until an agent makes its own
    (``ctx.tmp_dir.mkdir(parents=True)``); most episodes never do (then no path is built and
    nothing is removed after cleanup), so a worker killed mid-batch leaves no empty
    directory behind. The batch's name carries a random part, and ``BatchRun.run`` removes
    it. ``path`` is None until read; copies of the attempt's context share the holder."""

    __slots__ = ("_batch", "_sample_id", "_attempt", "path")

    def __init__(self, batch: Path, sample_id: str, attempt: int) -> None:
        self._batch = batch
        self._sample_id = sample_id
        self._attempt = attempt
        self.path: Path | None = None

    def get(self) -> Path:
        if self.path is None:
            self.path = _attempt_dir(self._batch, self._sample_id, self._attempt)
        return self.path

    @classmethod
    def given(cls, path: Path) -> LazyTmp:
        tmp = _new(cls)
        tmp.path = path
        return tmp


class AttemptContext(EpisodeContext):
    """The ``EpisodeContext`` a ``BatchRun`` builds per attempt: the same fields, with
    ``tmp_dir`` made on first read (:class:`LazyTmp`). Built by :func:`attempt_context`;
    ``dataclasses.replace`` of one (which passes ``tmp_dir``) works as on the base class."""

    @property
    def tmp_dir(self) -> Path:
        tmp: LazyTmp = self.__dict__["_tmp"]
        return tmp.get()

    @tmp_dir.setter
    def tmp_dir(self, value: Path) -> None:  # the dataclass __init__ (replace) sets it
        self.__dict__["_tmp"] = LazyTmp.given(value)

    def __repr__(self) -> str:
        return EpisodeContext.__repr__(self).replace(type(self).__qualname__, "EpisodeContext", 1)


def attempt_context(**fields: Any) -> AttemptContext:
    """An :class:`AttemptContext` of ``fields`` (every field but ``tmp_dir``, plus the
    ``_tmp`` holder), checked like ``EpisodeContext(...)`` without its per-field setattr."""
    ctx = _new(AttemptContext)
    ctx.__dict__.update(fields)
    ctx.__post_init__()
    return ctx


_new = object.__new__
_set = object.__setattr__


def _attempt_dir(batch: Path, sample_id: str, attempt: int) -> Path:
    return batch / f"{_safe(sample_id)}-a{attempt}"


def _safe(name: str) -> str:
    if _PLAIN.fullmatch(name):  # the usual sample id: nothing to replace (one C pass)
        return name
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


_PLAIN = re.compile(r"[A-Za-z0-9._-]*")


def remove_dir(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)

