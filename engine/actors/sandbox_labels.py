"""Sandbox labelling: every sandbox an episode opens carries its worker, rollout, batch, sample
and attempt, so the worker that claims a dead worker's batch reaps what that worker left
running (``SandboxProvider.reap`` selects on the labels)."""

from __future__ import annotations

from collections.abc import Mapping

from engine.sandbox.base import Sandbox, SandboxLimits, SandboxProvider

__all__ = ["LabelledProvider", "sandbox_labels"]


def sandbox_labels(
    *, worker: str, rollout_id: str, batch_id: str, sample_id: str = "", attempt: int = 0
) -> dict[str, str]:
    """Labels stamped on every sandbox an episode opens; reaping selects on them."""
    labels = {"rollout.worker": worker, "rollout.rollout": rollout_id, "rollout.batch": batch_id}
    if sample_id:
        labels["rollout.sample"] = sample_id
        labels["rollout.attempt"] = str(attempt)
    return labels


class LabelledProvider:
    """A sandbox provider that stamps the episode's labels on every sandbox it creates."""

    def __init__(self, inner: SandboxProvider, labels: Mapping[str, str]) -> None:
        self._inner = inner
        self._labels = dict(labels)

    def create(self, *, labels: Mapping[str, str], limits: SandboxLimits | None = None) -> Sandbox:
        return self._inner.create(labels={**labels, **self._labels}, limits=limits)

    async def reap(self, label_selector: Mapping[str, str]) -> int:
        return await self._inner.reap(label_selector)
