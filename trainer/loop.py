"""The training iterations: request -> RolloutReady -> load -> collate -> loss -> step -> publish.

One iteration (``train``):

1. ``client.request(iteration=i, policy_version=v, algorithm=...)`` for a training rollout;
2. ``client.wait_load``: the ready event and the samples, the rollout stream folded while
   it is written (a ``RolloutFailed`` ends the run with the engine's reason);
3. ``collate``;
4. the student's logprobs on the sampled tokens, the lane's loss (:func:`lane_loss`) and an
   optimizer step, ``steps_per_rollout`` times on the same batch (:func:`optimize`; the
   metrics are the first step's: the loss and KL of the policy that sampled the rollout).
   GRPO takes an off-policy :class:`~engine.losses.Correction` and, with ``decoupled``,
   recomputes the proximal policy's logprobs before the update (docs/trainers.md,
   "Off-policy corrections");
5. the new weights saved as ``weights/v<v+1>`` and ``publisher.publish(v + 1, folder)``: the
   next request samples them.

An eval pass (``kind="eval"``, the bundled eval datasets, the student only) runs before the
first update and every ``eval_every`` iterations after it, and after the last. Every iteration
appends one JSON row to ``metrics.jsonl`` (``trainer.report``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from engine.client import collate
from engine.errors import ConfigError
from engine.events.catalog import RolloutKind, RolloutReady
from engine.losses import (
    Correction,
    LossOutput,
    group_advantages,
    grpo_loss,
    k3,
    k3_loss,
    mixed_ce_k3_loss,
    proximal_log_probs,
    token_mean,
)
from engine.projections.samples import scalar_reward
from engine.sample import Sample
from trainer.policy import FrozenModel, Policy
from trainer.publish import Publisher

__all__ = ["ALGORITHMS", "LoopConfig", "Rollouts", "evaluate", "lane_loss", "optimize", "train"]

ALGORITHMS: dict[str, str] = {"grpo": "grpo", "opd": "opd", "mixed": "mixed_ce_k3"}
"""The trainer's ``--algorithm`` and the request's ``algorithm`` (which picks the lane)."""

TEACHER_ALGORITHMS = frozenset({"opd", "mixed"})

T = TypeVar("T")


class Rollouts(Protocol):
    """What the loop asks of its rollout source: ``RolloutClient``'s request and load."""

    async def request(
        self, *, iteration: int, n_prompts: int, n_samples_per_prompt: int | None = None,
        policy_version: int = 0, knobs: Mapping[str, Any] | None = None,
        kind: RolloutKind | str = RolloutKind.TRAIN, seed: int = 0,
        datasets: Sequence[str] | None = None, algorithm: str = "grpo",
    ) -> str: ...

    async def wait_load(
        self, rollout_id: str, timeout: float | None = None
    ) -> tuple[RolloutReady, list[Sample]]: ...


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    algorithm: str
    iterations: int
    n_prompts: int = 8
    samples_per_prompt: int = 4
    clip_eps: float = 0.2
    steps_per_rollout: int = 1
    seed: int = 0
    eval_every: int = 0  # 0: only before the first update and after the last
    eval_passes: bool = True
    eval_samples_per_prompt: int | None = None  # None: the eval datasets' own
    timeout_s: float = 900.0
    datasets: Sequence[str] | None = None
    knobs: dict[str, Any] = field(default_factory=dict)
    correction: Correction = field(default_factory=Correction)  # grpo only
    decoupled: bool = False  # grpo only: recompute the proximal policy before the update

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(
                f"unknown algorithm {self.algorithm!r}: expected one of {sorted(ALGORITHMS)}"
            )
        if self.iterations < 1:
            raise ConfigError(f"iterations must be >= 1, got {self.iterations}")
        if self.steps_per_rollout < 1:
            raise ConfigError(f"steps_per_rollout must be >= 1, got {self.steps_per_rollout}")
        if self.algorithm != "grpo" and (self.correction.mode != "none" or self.decoupled):
            raise ConfigError(
                f"an off-policy correction (correction {self.correction.mode!r}, decoupled "
                f"{self.decoupled}) applies to grpo's policy-gradient ratio; algorithm "
                f"{self.algorithm!r} has none"
            )

    @property
    def corrected(self) -> bool:
        return self.correction.mode != "none" or self.decoupled


def _need(batch: dict[str, torch.Tensor], algorithm: str, *keys: str) -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ConfigError(
            f"algorithm {algorithm!r} needs {', '.join(missing)} from collate, which this "
            f"rollout's batch lacks (it has {', '.join(sorted(batch))}): the engine's lane for "
            f"{ALGORITHMS[algorithm]!r} did not produce them"
        )


def lane_loss(
    algorithm: str,
    log_probs: torch.Tensor,
    batch: dict[str, torch.Tensor],
    *,
    groups: torch.Tensor,
    clip_eps: float = 0.2,
    reference_log_probs: torch.Tensor | None = None,
    correction: Correction | None = None,
    proximal: torch.Tensor | None = None,
) -> LossOutput:
    """The loss of ``algorithm``'s lane on a collated ``batch`` (docs/trainers.md, Losses).

    Rows with ``remove_sample`` take no part. ``grpo``: group-normalized advantages over
    ``groups`` and the clipped ratio against ``rollout_log_probs`` over ``loss_mask``, or,
    with ``correction`` / ``proximal``, against the proximal policy with importance weights
    (``engine.losses.grpo_loss``); with ``reference_log_probs`` the metric ``kl`` is K3 of
    the policy against that reference.
    ``opd``: K3 against ``teacher_log_probs`` over ``action_mask`` (``loss_mask`` when the
    batch has none: the capture lane already made it the action mask). ``mixed``: the
    sentinel kernel over ``action_mask`` or ``is_teacher_mask`` (the mixed lane's
    ``loss_mask``, engine.projections.lanes): CE where ``teacher_log_probs`` holds the +1.0
    sentinel (teacher tokens), K3 on the student's action tokens.
    """
    valid = ~batch["remove_sample"].bool()
    rows = valid[:, None].to(log_probs.dtype)
    if algorithm == "grpo":
        adv = group_advantages(batch["rewards"], groups, valid=valid)
        mask = batch["loss_mask"] * rows
        out = grpo_loss(log_probs, batch["rollout_log_probs"], adv, mask, clip_eps=clip_eps,
                        correction=correction, proximal=proximal)
        if reference_log_probs is not None:
            kl = token_mean(k3(log_probs.detach(), reference_log_probs), mask)
            out.metrics["kl"] = float(kl)
        # The share of groups whose rewards differ: only they carry a gradient.
        kept = groups[valid]
        ids = torch.unique(kept)
        out.metrics["signal_groups"] = (
            sum(int(torch.unique(batch["rewards"][valid][kept == g]).numel() > 1) for g in ids)
            / max(1, ids.numel())
        )
        return out
    if algorithm == "opd":
        _need(batch, algorithm, "teacher_log_probs")
        mask = batch.get("action_mask", batch["loss_mask"]) * rows
        return k3_loss(log_probs, batch["teacher_log_probs"], mask)
    if algorithm == "mixed":
        _need(batch, algorithm, "teacher_log_probs", "action_mask", "is_teacher_mask")
        trained = (batch["action_mask"] + batch["is_teacher_mask"]).clamp(max=1).to(rows.dtype)
        return mixed_ce_k3_loss(log_probs, batch["teacher_log_probs"], trained * rows)
    raise ConfigError(f"unknown algorithm {algorithm!r}: expected one of {sorted(ALGORITHMS)}")


def optimize(
    policy: Policy,
    batch: dict[str, torch.Tensor],
    config: LoopConfig,
    *,
    groups: torch.Tensor,
    version: int,
    reference_log_probs: torch.Tensor | None = None,
) -> tuple[LossOutput, LossOutput, float]:
    """``config.steps_per_rollout`` optimizer steps on one batch; returns the first step's
    loss output, the last one's, and the last gradient norm.

    A corrected GRPO (``config.corrected``) anchors every step at the policy before the
    update. ``decoupled``: the trainer's logprobs recomputed without gradient before the first
    step, with the rollout's value on the tokens sampled at ``version`` (the weights the
    trainer holds: ``engine.losses.proximal_log_probs``). Otherwise the first step's own
    logprobs, detached, anchor the later steps.
    """
    proximal = None
    if config.decoupled:
        with torch.no_grad():
            recomputed = policy.log_probs(batch)
        proximal = proximal_log_probs(recomputed, batch["rollout_log_probs"],
                                      batch["token_versions"], version)
    outputs: list[LossOutput] = []
    grad_norm = 0.0
    for _ in range(config.steps_per_rollout):
        # Later steps reuse the rollout: the PPO ratio then moves off 1 and the clip acts.
        log_probs = policy.log_probs(batch)
        out = lane_loss(config.algorithm, log_probs, batch, groups=groups,
                        clip_eps=config.clip_eps, reference_log_probs=reference_log_probs,
                        correction=config.correction, proximal=proximal)
        if config.corrected and proximal is None:
            proximal = log_probs.detach()
        outputs.append(out)
        grad_norm = policy.step(out.loss)
    return outputs[0], outputs[-1], grad_norm


async def watched(
    waiting: Awaitable[T], check_alive: Callable[[], None], *, every_s: float = 2.0
) -> T:
    """Await ``waiting`` while calling ``check_alive`` every ``every_s`` seconds: a stack
    process that died (a worker that could not start, say) ends the wait with its error
    instead of the rollout's timeout."""
    task = asyncio.ensure_future(waiting)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=every_s)
            if done:
                return task.result()
            check_alive()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _rewards(samples: Sequence[Sample]) -> dict[str, float]:
    """Mean reward overall and per dataset, over samples that were not removed."""
    by: dict[str, list[float]] = defaultdict(list)
    for s in samples:
        if s.remove_sample:
            continue
        r = scalar_reward(s.reward)
        by["reward"].append(r)
        by[f"reward/{s.metadata.get('dataset', '?')}"].append(r)
    return {k: sum(v) / len(v) for k, v in sorted(by.items())}


async def evaluate(
    client: Rollouts, *, iteration: int, version: int, seed: int, timeout_s: float,
    samples_per_prompt: int | None = None, check_alive: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """One eval pass of the current policy: mean reward overall and per eval dataset.
    ``samples_per_prompt`` overrides the eval datasets' ``n_samples_per_eval_prompt``."""
    rid = await client.request(iteration=iteration, n_prompts=1, kind=RolloutKind.EVAL,
                               n_samples_per_prompt=samples_per_prompt,
                               policy_version=version, seed=seed)
    _ready, samples = await watched(client.wait_load(rid, timeout=timeout_s), check_alive)
    return {"eval_" + k: v for k, v in _rewards(samples).items()} | {
        "eval_samples": float(sum(not s.remove_sample for s in samples))
    }


async def train(
    client: Rollouts,
    policy: Policy,
    publisher: Publisher,
    config: LoopConfig,
    *,
    weights_dir: Path,
    pad_token_id: int,
    on_row: Callable[[dict[str, Any]], None],
    reference: FrozenModel | None = None,
    check_alive: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Run ``config.iterations`` iterations (see the module docstring); returns the rows."""
    rows: list[dict[str, Any]] = []
    version = 0
    began = time.monotonic()
    request_algorithm = ALGORITHMS[config.algorithm]
    for i in range(config.iterations):
        row: dict[str, Any] = {"iteration": i, "version": version,
                               "algorithm": config.algorithm}
        t0 = time.monotonic()
        if config.eval_passes and (i == 0 or (config.eval_every and i % config.eval_every == 0)):
            check_alive()
            row |= await evaluate(client, iteration=i, version=version,
                                  seed=config.seed, timeout_s=config.timeout_s,
                                  samples_per_prompt=config.eval_samples_per_prompt,
                                  check_alive=check_alive)
        t1 = time.monotonic()
        check_alive()
        rid = await client.request(
            iteration=i, n_prompts=config.n_prompts,
            n_samples_per_prompt=config.samples_per_prompt, policy_version=version,
            seed=config.seed * 100_003 + i, algorithm=request_algorithm,
            datasets=list(config.datasets) if config.datasets else None,
            knobs=config.knobs,
        )
        ready, samples = await watched(
            client.wait_load(rid, timeout=config.timeout_s), check_alive
        )
        if config.algorithm in TEACHER_ALGORITHMS:
            # An aborted sample is a masked dummy without teacher logprobs; it carries no
            # gradient, and collate builds teacher_log_probs only when every row has them.
            trained = [s for s in samples if s.teacher_log_probs is not None] or samples
        else:
            trained = samples
        batch = collate(trained, pad_token_id=pad_token_id)
        t2 = time.monotonic()
        groups = torch.tensor([s.group_index for s in trained], dtype=torch.int64)
        ref = reference.log_probs(batch) if reference is not None else None
        first, out, grad_norm = optimize(policy, batch, config, groups=groups, version=version,
                                         reference_log_probs=ref)
        t3 = time.monotonic()
        version += 1
        uri = policy.save(weights_dir / f"v{version}")
        await watched(publisher.publish(version, str(uri)), check_alive)
        t4 = time.monotonic()
        row |= {
            "rollout_id": rid,
            "samples": len(samples),
            "dropped": len(ready.dropped_sample_ids),
            "aborted": sum(s.remove_sample for s in samples),
            **_rewards(samples),
            "loss": float(first.loss.detach()),
            **first.metrics,
            **({"correction": f"{config.correction.mode}/{config.correction.level}",
                "decoupled": config.decoupled} if config.algorithm == "grpo" else {}),
            **({"loss_last_step": float(out.loss.detach())}
               if config.steps_per_rollout > 1 else {}),
            "grad_norm": grad_norm,
            "published_version": version,
            "eval_s": round(t1 - t0, 3),
            "rollout_s": round(t2 - t1, 3),
            "train_s": round(t3 - t2, 3),
            "publish_s": round(t4 - t3, 3),
            "wall_s": round(t4 - began, 3),
        }
        rows.append(row)
        on_row(row)
    if config.eval_passes:
        check_alive()
        final = {"iteration": config.iterations, "version": version,
                 "algorithm": config.algorithm}
        final |= await evaluate(client, iteration=config.iterations, version=version,
                                seed=config.seed, timeout_s=config.timeout_s,
                                samples_per_prompt=config.eval_samples_per_prompt,
                                check_alive=check_alive)
        final["wall_s"] = round(time.monotonic() - began, 3)
        rows.append(final)
        on_row(final)
    return rows
