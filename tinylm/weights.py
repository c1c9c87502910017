"""SGLang's weight-sync routes for the tiny model server: update, version, pause, flush.

Shapes and semantics follow SGLang 0.5.23 (``srt/entrypoints/http_server.py``,
``srt/managers/io_struct.py``, ``srt/managers/tokenizer_manager.py``):

- ``POST /update_weights_from_disk`` takes ``UpdateWeightFromDiskReqInput``: ``model_path`` (a
  Hugging Face folder, ``config.json`` + ``model.safetensors``), ``load_format`` (None, ``auto``
  or ``safetensors`` here), ``abort_all_requests`` (default False), ``weight_version`` (None
  keeps the current one), ``flush_cache`` and the GPU-only flags (accepted, no effect on CPU).
  It answers ``UpdateWeightFromDiskReqOutput`` ``{"success", "message", "num_paused_requests"}``,
  200 on success and 400 on failure (a failed load keeps the old weights and version).
- **Two views of the version** (``Scheduler.update_weights_from_disk`` then
  ``TokenizerManager.update_weights_from_disk``): the scheduler records ``weight_version`` as
  soon as the weights are loaded, and a finished reply's ``weight_versions`` /
  ``weight_version`` come from it; ``/get_model_info``, ``/get_weight_version`` and a running
  stream's chunks read the server's own copy (``WeightControl.version``), set only when the
  whole update succeeded. With ``flush_cache`` (the default) the update then flushes the cache
  and fails if it cannot (``WeightUpdater.flush_cache_after_weight_update``: requests still
  running, or queued while generation is not paused, which happens when generation is paused
  in place): the weights are swapped and replies report the new version, but the update
  answers 400 ``Weights were updated, but the cache was not flushed ...`` and the model path
  and ``/get_model_info``'s version stay the old ones. Pass ``"flush_cache": false`` to update
  under requests paused in place.
- **Requests in flight during an update** (``TokenizerManager.update_weights_from_disk``): with
  ``abort_all_requests`` they are aborted first; either way the update takes the writer side of
  ``model_update_lock`` while every ``/generate`` holds its reader side for its whole life, so
  the update **waits for in-flight requests to finish** and requests arriving meanwhile wait
  behind it. When generation is paused the lock is skipped and the weights change at once;
  requests paused ``in_place`` then continue on the new weights (with their old KV cache).
- ``GET /get_weight_version`` answers ``{"weight_version": ...}``. SGLang 0.5.23 no longer serves
  this route (the version is in ``/model_info``, ``/get_model_info`` and every ``meta_info``);
  earlier 0.5 releases did, with this shape, and clients still probe it.
- ``POST /pause_generation`` takes ``PauseGenerationReqInput.mode``: ``abort`` (default: abort
  everything, wait until no request is in flight) or ``in_place`` (stop stepping; requests keep
  their state); ``retract`` needs a KV cache that can be recomputed and is refused here.
  ``/continue_generation`` resumes. Both answer ``{"message", "status": "ok"}``. While paused,
  new ``/generate`` requests wait (``is_pause_cond``).
- ``GET|POST /flush_cache`` answers plain text: 200 ``Cache flushed. ...`` when nothing is
  running or waiting, else 400 (SGLang refuses to flush under load). tinylm keeps no prefix
  cache, so a flush changes nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinylm.errors import ConfigError
from tinylm.runtime import read_checkpoint
from tinylm.scheduler import GenerationScheduler, SchedulerClosed

__all__ = ["FLUSHED", "NOT_FLUSHED", "UpdateFromDisk", "WeightControl"]

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
NOT_FLUSHED = (  # WeightUpdater.flush_cache_after_weight_update
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)
_LOAD_FORMATS = (None, "auto", "safetensors")
_PAUSE_MODES = ("abort", "in_place", "retract")


class WeightRequestError(ValueError):
    """A malformed admin request; the message names the field."""


@dataclass(frozen=True, kw_only=True)
class UpdateFromDisk:
    """A validated ``UpdateWeightFromDiskReqInput``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> UpdateFromDisk:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise WeightRequestError(f"model_path must be a non-empty string, got {path!r}")
        if body.get("load_format") not in _LOAD_FORMATS:
            raise WeightRequestError(
                f"load_format must be one of {list(_LOAD_FORMATS)} for tinylm, "
                f"got {body.get('load_format')!r}"
            )
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise WeightRequestError(f"weight_version must be a string, got {version!r}")
        flags: dict[str, bool] = {}
        for key in (
            "abort_all_requests",
            "flush_cache",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
        ):
            value = body.get(key, key == "flush_cache")
            if not isinstance(value, bool):
                raise WeightRequestError(f"{key} must be a boolean, got {value!r}")
            flags[key] = value
        return cls(
            model_path=path,
            load_format=body.get("load_format"),
            abort_all_requests=flags["abort_all_requests"],
            weight_version=version,
            flush_cache=flags["flush_cache"],
        )


class WeightControl:
    """The pause state and the model-update lock of one server (see the module docstring)."""

    def __init__(self, scheduler: GenerationScheduler, *, model_path: Path) -> None:
        self._scheduler = scheduler
        self.model_path = str(model_path)
        self.version = scheduler.weight_version  # the server's view (the module docstring)
        self._cv = threading.Condition()
        self._paused = False
        self._readers = 0  # requests in flight (``model_update_lock`` reader side)
        self._writers = 0  # updates waiting for or holding the writer side
        self._update = threading.Lock()  # one update at a time
        self._closed = False
        self._waiting = 0  # requests in ``enter`` waiting for a pause or an update to end

    @property
    def paused(self) -> bool:
        with self._cv:
            return self._paused

    def enter(self) -> None:
        """A generation request starts: waits while generation is paused or an update waits
        for the lock (writers first, as SGLang's ``RWLock``). Pair with ``leave``, called when
        the scheduler has finished the request (``Pending.on_done``)."""
        with self._cv:
            self._waiting += 1
            try:
                self._cv.wait_for(lambda: self._closed or not (self._paused or self._writers))
            finally:
                self._waiting -= 1
            if self._closed:
                raise SchedulerClosed("tinylm server is shutting down")
            self._readers += 1

    def waiting(self) -> int:
        """How many requests wait in ``enter`` now."""
        with self._cv:
            return self._waiting

    def try_enter(self) -> bool:
        """``enter`` without waiting: False (and nothing taken) while it would have to wait."""
        with self._cv:
            if self._closed:
                raise SchedulerClosed("tinylm server is shutting down")
            if self._paused or self._writers:
                return False
            self._readers += 1
            return True

    def leave(self) -> None:
        with self._cv:
            self._readers -= 1
            self._cv.notify_all()

    def update_from_disk(self, update: UpdateFromDisk) -> tuple[bool, str]:
        """Load ``update.model_path`` and swap it in; (success, message) as SGLang's reply."""
        with self._update:
            if update.abort_all_requests:
                self._scheduler.abort(None)
            try:
                weights, shape = read_checkpoint(update.model_path)
            except (ConfigError, OSError, ValueError) as exc:
                return False, f"Failed to get weights iterator: {exc}"
            with self._exclusive():
                try:
                    idle = self._scheduler.update_weights(weights, shape, update.weight_version)
                except ConfigError as exc:
                    return False, f"Failed to update weights: {exc}. Kept the old weights."
                if update.flush_cache and not idle:
                    return False, NOT_FLUSHED
                self.model_path = update.model_path
                if update.weight_version is not None:
                    self.version = update.weight_version
        message = "Succeeded to update model weights."
        if update.weight_version is not None:
            message += f" Weight version updated to {update.weight_version}."
        return True, message

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """The writer side of the model-update lock, skipped while paused (SGLang's
        ``nullcontext()`` when ``is_pause``)."""
        with self._cv:
            if self._paused:
                held = False
            else:
                held = True
                self._writers += 1
                self._cv.wait_for(lambda: not self._readers)
        try:
            yield
        finally:
            if held:
                with self._cv:
                    self._writers -= 1
                    self._cv.notify_all()

    def pause(self, body: dict[str, Any]) -> None:
        mode = body.get("mode", "abort")
        if mode not in _PAUSE_MODES:
            raise WeightRequestError(f"mode must be one of {list(_PAUSE_MODES)}, got {mode!r}")
        if mode == "retract":
            raise WeightRequestError(
                "mode 'retract' is not supported by tinylm (its KV cache is not recomputed); "
                "use 'abort' or 'in_place'"
            )
        with self._cv:
            self._paused = True
        if mode == "in_place":
            self._scheduler.pause(True)
            return
        self._scheduler.abort(None)
        with self._cv:
            self._cv.wait_for(lambda: not self._readers)

    def resume(self) -> None:
        self._scheduler.pause(False)
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def close(self) -> None:
        """Release requests waiting for a pause or an update to end (the server is closing)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def flush(self) -> tuple[bool, str]:
        if self._scheduler.running_rids():
            return False, "Flush cache failed: there are running or waiting requests.\n"
        return True, FLUSHED
