"""Analysis dumps of a ready rollout: token-level data for offline tools.

Each dump is armed by its directory (``DumpConfig``; ``ROLLOUT_DISTILL_DUMP_DIR``,
``ROLLOUT_MIXED_DUMP_DIR``, ``ROLLOUT_STUDENT_DUMP_DIR``) and written from the samples as
the trainer loads them (``trainer_samples``), so it shows what the loss consumed:

* OPD discrepancy (``per_token`` lane, or captured with ``teacher_capture``):
  ``<distill_dir>/iter_<NNNNNN>-<rollout id>.pt``, teacher and student logprobs (what the
  K3 estimator consumes) and the action mask;
* mixed-loss (``mixed`` lane): ``<mixed_dir>/iter_<NNNNNN>-<rollout id>.pt``, the
  sentinel'd ``teacher_log_probs`` (+1.0 at teacher positions) and ``is_teacher_mask``, so a
  tool can split CE from K3 per position;
* student (eval rollouts): ``<student_dir>/iter_<NNNNNN>/<sample>.pt`` per finished sample
  (tokens, loss mask, rollout logprobs, reward) and a ``manifest.json``.

Format: ``torch.save`` of a dict; tensors are response-aligned, right-padded ``[B, R]`` with
``response_lengths`` [B]; aborted samples are left out. Files are written atomically, and a
dump is best-effort: a failure is logged and never fails or delays the rollout.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.events.arrays import PackedArray
from engine.events.catalog import RolloutKind
from engine.projections.lanes import Lane, request_lane
from engine.projections.readback import Rollout
from engine.projections.rollout import RolloutState
from engine.projections.samples import scalar_reward, trainer_samples
from engine.sample import Sample

__all__ = ["DumpConfig", "write_dumps"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DumpConfig:
    """Where each dump goes; None leaves it off."""

    distill_dir: Path | None = None
    mixed_dir: Path | None = None
    student_dir: Path | None = None

    @property
    def armed(self) -> bool:
        return any(d is not None for d in (self.distill_dir, self.mixed_dir, self.student_dir))


def write_dumps(rollout: Rollout, config: DumpConfig) -> list[Path]:
    """Write the dumps ``config`` arms for this ready rollout; the files written. Never
    raises."""
    state = rollout.state
    if not config.armed or state.ready is None or state.request is None:
        return []
    written: list[Path] = []
    try:
        samples = [s for s in trainer_samples(rollout) if not s.remove_sample]
    except Exception as exc:  # noqa: BLE001 - best-effort by contract
        logger.warning("dumps of rollout %s skipped: %s", state.rollout_id, exc)
        return []
    request = state.request
    lane = request_lane(request)
    name = f"iter_{request.iteration:06d}-{_safe(request.rollout_id)}.pt"
    jobs: list[tuple[str, Callable[[], list[Path]]]] = []
    scored = [s for s in samples if s.teacher_log_probs is not None]
    if config.distill_dir is not None and lane is not Lane.MIXED and scored:
        target = config.distill_dir / name
        jobs.append(("OPD discrepancy", partial(_save_built, target, _distill, state, scored)))
    if config.mixed_dir is not None and lane is Lane.MIXED and scored:
        target = config.mixed_dir / name
        jobs.append(("mixed-loss", partial(_save_built, target, _mixed, state, scored)))
    if config.student_dir is not None and request.kind is RolloutKind.EVAL and samples:
        folder = config.student_dir / f"iter_{request.iteration:06d}"
        jobs.append(("student", partial(_student, state, samples, folder)))
    for what, job in jobs:
        try:
            written.extend(job())
        except Exception as exc:  # noqa: BLE001 - a dump never fails the rollout
            logger.warning(
                "the %s dump of rollout %s failed (the rollout is not affected): %s: %s",
                what, state.rollout_id, type(exc).__name__, exc,
            )
    return written


def _save_built(
    path: Path,
    build: Callable[[RolloutState, Sequence[Sample]], dict[str, Any]],
    state: RolloutState,
    samples: Sequence[Sample],
) -> list[Path]:
    return [_save(path, build(state, samples))]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _save(path: Path, obj: Any, write: Callable[[Any, Path], object] = torch.save) -> Path:
    """``write(obj, tmp)``, then ``tmp`` renamed to ``path``: never half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(obj, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _padded(
    arrays: Sequence[PackedArray | None], lengths: Sequence[int], dtype: Any
) -> torch.Tensor:
    out = np.zeros((len(lengths), max(lengths, default=0)), dtype=dtype)
    for row, (array, n) in enumerate(zip(arrays, lengths, strict=True)):
        if array is not None:
            out[row, :n] = array.numpy()[:n]
    return torch.from_numpy(out)


def _header(state: RolloutState, samples: Sequence[Sample]) -> dict[str, Any]:
    request = state.request
    assert request is not None
    return {
        "rollout_id": request.rollout_id,
        "iteration": request.iteration,
        "algorithm": request.algorithm,
        "policy_version": request.policy_version,
        "sample_ids": [s.sample_id for s in samples],
        "response_lengths": torch.tensor([s.response_length for s in samples], dtype=torch.int64),
    }


def _distill(state: RolloutState, samples: Sequence[Sample]) -> dict[str, Any]:
    n = [s.response_length for s in samples]
    return {
        **_header(state, samples),
        "teacher_log_probs": _padded([s.teacher_log_probs for s in samples], n, np.float32),
        "rollout_log_probs": _padded([s.rollout_log_probs for s in samples], n, np.float32),
        "action_mask": _padded([s.action_mask or s.loss_mask for s in samples], n, np.float32),
    }


def _mixed(state: RolloutState, samples: Sequence[Sample]) -> dict[str, Any]:
    n = [s.response_length for s in samples]
    return {
        **_header(state, samples),
        "teacher_log_probs": _padded([s.teacher_log_probs for s in samples], n, np.float32),
        "rollout_log_probs": _padded([s.rollout_log_probs for s in samples], n, np.float32),
        "is_teacher_mask": _padded([s.is_teacher_mask for s in samples], n, np.float32),
        "loss_mask": _padded([s.loss_mask for s in samples], n, np.float32),
    }


def _student(state: RolloutState, samples: Sequence[Sample], folder: Path) -> list[Path]:
    request = state.request
    assert request is not None
    written: list[Path] = []
    entries: list[dict[str, Any]] = []
    for s in samples:
        file = f"{_safe(s.sample_id)}.pt"
        n = s.response_length
        written.append(
            _save(
                folder / file,
                {
                    "sample_id": s.sample_id,
                    "tokens": s.tokens.torch().to(torch.int64),
                    "prompt_length": len(s.tokens) - n,
                    "loss_mask": s.loss_mask.torch().to(torch.float32),
                    "rollout_log_probs": (
                        s.rollout_log_probs.torch()
                        if s.rollout_log_probs is not None
                        else torch.zeros(n, dtype=torch.float32)
                    ),
                    "reward": scalar_reward(s.reward),
                },
            )
        )
        entries.append(
            {
                "sample_id": s.sample_id,
                "file": file,
                "index": s.index,
                "dataset": s.metadata.get("dataset"),
                "reward": scalar_reward(s.reward),
                "response_length": n,
            }
        )
    manifest = {
        "rollout_id": request.rollout_id,
        "iteration": request.iteration,
        "policy_version": request.policy_version,
        "samples": entries,
    }
    text = json.dumps(manifest, indent=1, sort_keys=True) + "\n"
    written.append(_save(folder / "manifest.json", text, lambda t, tmp: tmp.write_text(t)))
    return written
