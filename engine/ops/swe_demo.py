"""``rollout demo --task swe``: the pieces the demo swaps in for the SWE-style task.

The bundled ``swe`` task runs mini-swe-agent through the recording proxy on a tinylm
taught mini-swe-agent's reply format; the demo then shows one captured trajectory as the
trainer receives it, each reply (``loss_mask`` 1, with logprobs) and observation (0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "SWE_EVALUATORS",
    "SWE_ROLLOUT_YAML",
    "SWE_TRAIN_STEPS",
    "ensure_swe_model",
    "trajectory_lines",
]

_TASKS = Path(__file__).resolve().parents[1] / "tasks"
SWE_ROLLOUT_YAML = _TASKS / "swe_rollout.yaml"
SWE_EVALUATORS = _TASKS / "swe_evaluators.py"
SWE_TRAIN_STEPS = 200
"""Format-training steps of the demo's SWE model (about a minute on 2 free cores)."""


def ensure_swe_model(model_dir: Path, train_steps: int | None, say: Callable[[str], None]) -> None:
    """Build the format-trained tinylm once; later runs reuse it."""
    if (model_dir / "config.json").is_file():
        say(f"model     tinylm (mini-swe-agent format) at {model_dir} (built earlier)")
        return
    from engine.tasks.swe_format import init_swe_model

    steps = SWE_TRAIN_STEPS if train_steps is None else train_steps
    say(f"model     building a tinylm that speaks mini-swe-agent's format into {model_dir}: "
        f"{steps} training steps (once; later runs reuse it)")  # fmt: skip
    began = time.monotonic()
    init_swe_model(model_dir, steps=steps, log=lambda msg: say(f"          {msg}"))
    say(f"model     built in {time.monotonic() - began:.0f}s")


def _segments(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(start, end, mask)`` runs of equal mask values."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, int(mask[start])))
            start = i
    return out


def trajectory_lines(sample: Any, decode: Callable[[list[int]], str], *,
                     width: int = 100) -> list[str]:  # fmt: skip
    """One captured trajectory as the trainer sees it, one line per reply or observation."""
    response_length = int(sample.response_length)
    tokens = list(sample.tokens)
    response = tokens[len(tokens) - response_length :]
    mask = list(sample.loss_mask)
    logprobs = list(sample.rollout_log_probs) if sample.rollout_log_probs is not None else []
    generated = sum(mask)
    lines = [
        f"trajectory {sample.sample_id}: reward {sample.reward}, "
        f"{sample.termination_reason}, {len(tokens) - response_length} prompt tokens, "
        f"{response_length} response tokens ({generated} generated, loss_mask 1, with logprobs; "
        f"{response_length - generated} observation, loss_mask 0)"
    ]
    for start, end, m in _segments(mask):
        text = " ".join(decode(response[start:end]).split())
        if len(text) > width:
            text = text[: width - 3] + "..."
        if m and logprobs:
            mean = sum(logprobs[start:end]) / (end - start)
            lines.append(f"  model  {end - start:>4} tok  mean logprob {mean:7.3f}  {text}")
        else:
            lines.append(f"  obs    {end - start:>4} tok  {'':>20}  {text}")
    return lines
