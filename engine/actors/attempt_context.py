"""The ``EpisodeContext`` of one attempt, built on the hot path without what
``EpisodeContext(...)`` repeats per field, and its private temporary directory.
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
    """An attempt's ``tmp_dir``: a path inside the batch's directory, named on first read
    and never created here (an agent makes it if it needs one), so most episodes build no
    path and a worker killed mid-batch leaves no empty directory. ``path`` is None until
    read; copies of the attempt's context share the holder."""

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
    """An ``EpisodeContext`` whose ``tmp_dir`` is named on first read (:class:`LazyTmp`);
    ``dataclasses.replace`` works as on the base class."""

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
    """An :class:`AttemptContext` of ``fields`` (all but ``tmp_dir``, plus the ``_tmp``
    holder), checked like ``EpisodeContext(...)``."""
    ctx = _new(AttemptContext)
    ctx.__dict__.update(fields)
    ctx.__post_init__()
    return ctx


_new = object.__new__
_set = object.__setattr__


def _attempt_dir(batch: Path, sample_id: str, attempt: int) -> Path:
    return batch / f"{_safe(sample_id)}-a{attempt}"


def _safe(name: str) -> str:
    if _PLAIN.fullmatch(name):  # the usual sample id: one C pass, nothing to replace
        return name
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


_PLAIN = re.compile(r"[A-Za-z0-9._-]*")


def remove_dir(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)

