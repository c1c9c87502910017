"""Summaries of a finished rollout: failure classes, eval metrics and the eval artifacts.

Everything here is a pure function of a folded rollout: ``summary.json`` reads the fold's
records alone, the other artifacts the entries read back for them. The artifacts are rendered
as bytes (:func:`render_artifacts`) and written by :func:`engine.actors.artifacts.write_artifacts`,
which the live finalizer and ``rollout replay`` both call, so both produce the same bytes.
Output is deterministic: keys sorted, compact separators, floats rounded to 6 decimals, rows in
sample-index order.

Every sample falls in exactly one failure class (:meth:`engine.outcomes.FailureClass.of`, the
seeds' ``classify_termination``); it is correct when its class is ``success``. Per dataset,
``accuracy`` is the fraction correct and, where prompts have more than one sample, ``pass@k``
is the unbiased estimator ``1 - C(n-c, k) / C(n, k)`` averaged over prompts, for k = 1, 2, 4, ...
up to the smallest ``n``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` so that no large
binomial is formed.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from engine.events.catalog import RolloutReady, RolloutRequested
from engine.outcomes import FailureClass, TerminationReason
from engine.projections.readback import Rollout, wanted
from engine.projections.rollout import RolloutState, SampleRecord
from engine.projections.rows import sample_rows

__all__ = [
    "ARTIFACT_FILES",
    "FailureClass",
    "artifact_entries",
    "build_summary",
    "classify_termination",
    "dumps",
    "eval_details",
    "pass_at_k",
    "placement_log",
    "render_artifacts",
    "rows_metrics",
]


def classify_termination(reward: float, reason: TerminationReason | str | None) -> FailureClass:
    """Fold an outcome into its failure class; aborts win over the reward. A reason outside
    the family counts as no reason (the reward alone decides)."""
    if reason is not None and not isinstance(reason, TerminationReason):
        reason = _REASONS.get(reason)
    return FailureClass.of(reward, reason)


_REASONS = {r.value: r for r in TerminationReason}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``c`` correct out of ``n`` samples: ``1 - C(n-c,k)/C(n,k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


# ---------------------------------------------------------------- metrics


def _power_of_two_ks(n_min: int) -> list[int]:
    ks, k = [], 1
    while k <= n_min:
        ks.append(k)
        k *= 2
    if ks[-1] != n_min:
        ks.append(n_min)
    return ks


def _dataset_metrics(rows: Sequence[SampleRecord]) -> dict[str, float]:
    out = {"accuracy": sum(r.correct for r in rows) / len(rows)}
    groups: dict[int, list[SampleRecord]] = defaultdict(list)
    for r in rows:
        groups[r.group_index].append(r)
    n_min = min(len(g) for g in groups.values())
    if n_min > 1:
        for k in _power_of_two_ks(n_min):
            values = [pass_at_k(len(g), sum(r.correct for r in g), k) for g in groups.values()]
            out[f"pass@{k}"] = math.fsum(values) / len(values)
    return out


def _by_dataset(rows: Iterable[SampleRecord]) -> dict[str, list[SampleRecord]]:
    out: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in rows:
        out[r.dataset].append(r)
    return dict(sorted(out.items()))


def rows_metrics(rows: Sequence[SampleRecord], *, prefix: str = "eval") -> dict[str, float]:
    """``{prefix}/{dataset}/accuracy`` and ``{prefix}/{dataset}/pass@k`` (groups of n > 1)."""
    out: dict[str, float] = {}
    for name, ds_rows in _by_dataset(rows).items():
        for key, value in _dataset_metrics(ds_rows).items():
            out[f"{prefix}/{name}/{key}"] = value
    return out


# ---------------------------------------------------------------- artifacts


def _num(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"cannot write non-finite number {value} to a summary")
    rounded = round(float(value), 6)
    return 0.0 if rounded == 0 else rounded  # no "-0.0"


def _clean(obj: Any) -> Any:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | int):
        return obj
    if isinstance(obj, float):
        return _num(obj)
    if isinstance(obj, Mapping):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    raise TypeError(f"cannot write {type(obj).__name__} to a summary")


def dumps(obj: Any) -> str:
    """Deterministic JSON: sorted keys, compact, floats rounded to 6 decimals, UTF-8 text."""
    return json.dumps(_clean(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def build_summary(rollout: Rollout) -> dict[str, Any]:
    """``summary.json``: per-dataset counts per class and metrics, and the per-task list. A
    ready rollout's aborted tail samples with no terminal event count as ``tail_aborted``."""
    state = rollout.state
    rows = state.ordered()
    request, ready = state.request, state.ready
    tail: set[str] = set()
    if ready is not None and not ready.tail_carried:
        tail = set(ready.tail_sample_ids)
    classes = {r.sample_id: _class_of(r, tail) for r in rows}
    datasets: dict[str, Any] = {}
    for name, ds_rows in _by_dataset(rows).items():
        counts = _class_counts(ds_rows, classes)
        datasets[name] = {
            "n": len(ds_rows),
            "counts": counts,
            "metrics": _dataset_metrics(ds_rows),
        }
    totals = _class_counts(rows, classes)
    out: dict[str, Any] = {
        "rollout_id": state.rollout_id,
        "iteration": request.iteration if request is not None else None,
        "kind": request.kind.value if request is not None else None,
        "policy_version": request.policy_version if request is not None else None,
        "n_samples": len(rows),
        "counts": totals,
        "datasets": datasets,
        "kept": len(ready.sample_ids) if ready is not None else None,
        "dropped": len(ready.dropped_sample_ids) if ready is not None else None,
        "dummy": ready.dummy if ready is not None else None,
        "tasks": [
            {
                "sample_id": r.sample_id,
                "dataset": r.dataset,
                "group": r.group_index,
                "reward": r.reward,
                "class": classes[r.sample_id].value,
                "turns": r.turns,
            }
            for r in rows
        ],
    }
    # Present only for a request that uses them, so other summaries keep their bytes.
    if request is not None and request.max_staleness is not None:
        out["staleness"] = _staleness(request, ready)
    if request is not None and request.pinned_version is not None:  # and what its tokens had
        out["pinned"] = {"version": request.pinned_version,
                         "version_tokens": ready.version_tokens if ready is not None else None}
    if request is not None and request.n_planned_prompts > request.n_prompts:
        out["partial"] = {
            "overprovision": request.overprovision,
            "groups_needed": request.n_prompts,
            "groups_planned": request.n_planned_prompts,
            "tail": request.tail,
            "tail_samples": len(ready.tail_sample_ids) if ready is not None else None,
        }
    # The verification boundary's figures, when it re-scored any.
    checks = {k[7:]: v for k, v in (ready.metrics if ready else {}).items() if k[:7] == "verify/"}
    if checks:
        out["verify"] = checks
    return out


def _class_of(r: SampleRecord, tail: set[str]) -> FailureClass:
    if not r.done and r.sample_id in tail:
        return FailureClass.TAIL_ABORTED
    return r.failure_class


def _class_counts(
    rows: Iterable[SampleRecord], classes: Mapping[str, FailureClass]
) -> dict[str, int]:
    """Samples per failure class: the eight always, the engine's own two when present."""
    counts = {c.value: 0 for c in FailureClass if not c.engine_ended}
    for r in rows:
        value = classes[r.sample_id].value
        counts[value] = counts.get(value, 0) + 1
    return counts


def eval_details(rollout: Rollout) -> list[dict[str, Any]]:
    """One record per sample, in index order: outcome, class and diagnostics."""
    return [
        {
            "sample_id": r.sample_id,
            "index": r.index,
            "group": r.group_index,
            "dataset": r.dataset,
            "task_type": r.task_type,
            "reward": r.reward,
            "class": r.failure_class.value,
            "status": r.status.value,
            "termination_reason": _value(r.termination_reason),
            "agent_reason": _value(r.agent_reason),
            "abort_class": _value(r.abort_class),
            "error": r.error,
            "phase": r.phase,
            "attempt": r.attempt,
            "turns": r.turns,
            "response_length": r.response_length,
            "elapsed_s": r.elapsed_s,
            "window_s": r.window_s,
            "node": r.node,
        }
        for r in sample_rows(rollout)
    ]


def _value(member: StrEnum | None) -> str | None:
    return None if member is None else member.value


def placement_log(rollout: Rollout) -> list[dict[str, Any]]:
    """One record per turn of the attempt that ended each sample: where it ran."""
    out: list[dict[str, Any]] = []
    for r in rollout.state.ordered():
        for t in sorted(rollout.turns(r), key=lambda t: t.turn):
            out.append(
                {
                    "sample_id": r.sample_id,
                    "attempt": t.attempt,
                    "turn": t.turn,
                    "node": t.node,
                    "gpu": t.gpu,
                    "prompt_tokens": t.prompt_tokens,
                    "response_tokens": t.response_tokens,
                    "tool_calls": list(t.tool_calls),
                    "elapsed_s": t.elapsed_s,
                }
            )
    return out


ARTIFACT_FILES = ("summary.json", "eval_details.jsonl", "placement.jsonl", "samples.jsonl")


def _jsonl(records: Iterable[Any]) -> bytes:
    return "".join(dumps(r) + "\n" for r in records).encode()


def artifact_entries(state: RolloutState) -> list[str]:
    """The entry ids the artifacts of ``state`` are built from (every sample's, turns too)."""
    return wanted(state, state.samples, turns=True)


def render_artifacts(rollout: Rollout) -> dict[str, bytes]:
    """The artifact files of a rollout, name -> bytes (see :data:`ARTIFACT_FILES`);
    ``rollout`` holds the entries :func:`artifact_entries` names."""
    from engine.projections.samples import trainer_samples

    samples = trainer_samples(rollout) if rollout.state.ready is not None else []
    return {
        "summary.json": (dumps(build_summary(rollout)) + "\n").encode(),
        "eval_details.jsonl": _jsonl(eval_details(rollout)),
        "placement.jsonl": _jsonl(placement_log(rollout)),
        "samples.jsonl": _jsonl(s.model_dump(mode="json") for s in samples),
    }


def _staleness(request: RolloutRequested, ready: RolloutReady | None) -> dict[str, Any]:
    """The bound and what it did; a policy other than ``drop`` is named, with the stale
    samples the ``keep`` policy loaded without gradient (``kept_stale``), so that a drop
    summary keeps its bytes."""
    stale = ready.stale_sample_ids if ready is not None else None
    kept_stale = 0
    if ready is not None and request.staleness_policy == "keep":
        kept_stale = len(set(ready.stale_sample_ids).intersection(ready.sample_ids))
    out: dict[str, Any] = {
        "max_staleness": request.max_staleness,
        "trainer_version": ready.trainer_version if ready is not None else None,
        "excluded": len(stale) - kept_stale if stale is not None else None,
        "excluded_tokens": ready.stale_tokens if ready is not None else None,
    }
    if request.staleness_policy != "drop":
        out["policy"] = request.staleness_policy
    if request.staleness_policy == "keep":
        out["kept_stale"] = kept_stale if ready is not None else None
    return out
