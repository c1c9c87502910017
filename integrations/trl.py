"""TRL's ``GRPOTrainer`` trained on engine rollouts.

TRL 1.16 lets a caller replace its generation with ``rollout_func(prompts, trainer)``
(``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._generate``): it must return
``prompt_ids``, ``completion_ids`` and ``logprobs`` (one list per completion, the sampler's
logprob of each completion token); ``env_mask`` (1 on model tokens, 0 on tokens the
environment wrote) becomes TRL's tool mask, multiplied into its loss mask; every other key
is handed to the reward functions, one value per completion. TRL gives the function the
prompts of one generation batch, each repeated ``num_generations`` times in a row
(``RepeatSampler``), and reads the completions back in that order: consecutive runs of
``num_generations`` form its groups.

``EngineTRL`` is both ends of that contract:

* ``rollout_func``: one engine rollout per call (``n_prompts = len(prompts) //
  num_generations`` groups of ``num_generations``), asked at the policy version last
  published, loaded with ``wait_load`` and turned into TRL's fields by :func:`trl_fields`:
  the prompt's tokens, the response's tokens (model turns and tool output, multi-turn
  episodes whole), the engine's ``loss_mask`` as ``env_mask`` (tool output not trained on),
  the sampler's ``rollout_log_probs``, and, for :func:`engine_reward`, the engine's reward
  (``None`` for a removed sample: TRL leaves it out of its group's baseline and gives it no
  advantage), the sample ids, policy versions and per-token versions.
* ``callback()``: a ``TrainerCallback`` whose ``on_step_end`` (after each optimizer step)
  saves the model as a folder and publishes it through the engine's policy-version API
  (``publish_version`` then ``wait_version_active``, as ``trainer.publish.VersionPublisher``
  does): the weight syncer loads it on every model server, so the next rollout samples it and
  records its version.

The engine's scheduler picks the tasks (its datasets, its seed); TRL's dataset only paces the
generation batches: :func:`placeholder_dataset` gives it rows whose ``prompt`` is a
placeholder.

TRL keeps the ``logprobs`` as ``sampling_per_token_logps`` (its off-policy mask reads them,
``off_policy_mask_threshold``), and applies its importance-sampling correction against them
(``vllm_importance_sampling_*``: the ratio of its own logprobs of the sampled tokens to the
sampler's, multiplied into the loss) only on its vLLM path, where ``vllm_generation`` stands
for the sampler and ``sync_weights()`` pushes the weights before a generation.
``EngineTRL.correct_sampling(trainer)`` puts the engine in that place: the trainer takes the
vLLM path with a rollout function (TRL 1.16 then computes the ratio, and calls
``sync_weights`` only when the step changed), and ``sync_weights`` publishes the step's
weights unless the callback already has.

Checkpoints pad their embedding rows past the tokenizer, and the engine's servers (SGLang,
tinylm) never sample the spare ids and normalize over the real ones only; TRL's softmax runs
over every row. :func:`cut_spare_logits` makes the model TRL trains score as the servers do
(without it every logprob is off by the spare rows' mass). ``GRPOConfig`` turns ``bf16``
autocast on by default; the servers score in float32, and under bf16 TRL's logprobs of the
sampled tokens drift from theirs by about 5e-3 (tinylm): ``bf16=False`` keeps them within
1e-4.
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from engine.client import SyncRolloutClient
from engine.errors import ConfigError, RolloutError
from engine.events.catalog import RolloutKind
from engine.projections.samples import scalar_reward
from engine.sample import Sample

__all__ = [
    "EngineSampler",
    "EngineTRL",
    "PublishCallback",
    "RolloutRecord",
    "cut_spare_logits",
    "engine_reward",
    "placeholder_dataset",
    "trl_fields",
]

PLACEHOLDER_PROMPT = "(the engine's scheduler picks this task)"

_NOT_COPIED = frozenset({"model.safetensors", "config.json", "tinylm.json"})
"""Files of the source model folder a published version does not copy: the weights and
config ``save_pretrained`` writes, and tinylm's build report."""


def ordered(samples: Sequence[Sample], n_groups: int, group_size: int) -> list[Sample]:
    """``samples`` in TRL's order (by group, then index), checked to be ``n_groups`` groups of
    ``group_size``: TRL computes advantages over runs of ``group_size`` consecutive rows."""
    by_group: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        by_group[s.group_index].append(s)
    sizes = sorted(len(g) for g in by_group.values())
    if len(by_group) != n_groups or any(n != group_size for n in sizes):
        raise RolloutError(
            f"TRL needs {n_groups} groups of {group_size} samples; the rollout has "
            f"{len(by_group)} groups of sizes {sizes} (a filter that drops samples cannot "
            "feed TRL's fixed groups)"
        )
    return [s for g in sorted(by_group) for s in sorted(by_group[g], key=lambda s: s.index)]


def trl_fields(
    samples: Sequence[Sample], *, n_groups: int, group_size: int, pad_token_id: int
) -> dict[str, list[Any]]:
    """The ``rollout_func`` output for ``samples`` (see the module docstring). A removed
    sample (the two-token masked dummy) keeps its masked tokens, with one pad token as its
    prompt when it has none."""
    out: dict[str, list[Any]] = defaultdict(list)
    for s in ordered(samples, n_groups, group_size):
        if s.rollout_log_probs is None:
            raise RolloutError(
                f"sample {s.sample_id or s.index} has no rollout_log_probs: TRL needs the "
                "sampler's logprob of every completion token"
            )
        tokens = s.tokens.tolist()
        cut = len(tokens) - s.response_length
        out["prompt_ids"].append(tokens[:cut] or [pad_token_id])
        out["completion_ids"].append(tokens[cut:])
        out["logprobs"].append([float(x) for x in s.rollout_log_probs.tolist()])
        out["env_mask"].append([int(x) for x in s.loss_mask.tolist()])
        out["engine_reward"].append(None if s.remove_sample else scalar_reward(s.reward))
        out["sample_id"].append(s.sample_id)
        out["policy_version"].append(s.policy_version)
        out["token_versions"].append(
            s.token_versions.tolist() if s.token_versions is not None else None
        )
    return dict(out)


SPARE_LOGIT = -1e9
"""The bias :func:`cut_spare_logits` gives a spare id's logit: its probability is 0 in any
float type, and every logprob stays finite (entropies do not turn NaN)."""


def cut_spare_logits(model: Any, vocab_size: int) -> None:
    """Make ``model`` score ids ``>= vocab_size`` (the embedding's spare rows) as impossible,
    so its softmax is the servers'. It gives the output embedding a bias, 0 on the real ids
    and :data:`SPARE_LOGIT` on the spare ones, held as a buffer: never trained, never saved
    (the published weights are the model's own), and read by every path that projects
    through the head, TRL's fused log-prob kernel (``add_fused_lm_head``) included."""
    head = model.get_output_embeddings()
    rows = int(head.weight.shape[0])
    if not 0 < vocab_size <= rows:
        raise ConfigError(f"vocab_size must be in [1, {rows}] (the output rows), got {vocab_size}")
    if head.bias is not None:
        raise ConfigError("the output embedding has a bias of its own: cut its spare ids there")
    bias = torch.zeros(rows, dtype=head.weight.dtype, device=head.weight.device)
    bias[vocab_size:] = SPARE_LOGIT
    del head.bias
    head.register_buffer("bias", bias, persistent=False)


def engine_reward(
    prompts: list[Any], completions: list[Any], engine_reward: list[float | None], **_: Any
) -> list[float | None]:
    """TRL reward function: the reward the engine's evaluator gave each completion."""
    return list(engine_reward)


def placeholder_dataset(n: int) -> Any:
    """A ``datasets.Dataset`` of ``n`` placeholder prompts: TRL's sampler walks it to pace the
    generation batches; the tasks themselves come from the engine's scheduler."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * n})


@dataclass(frozen=True)
class RolloutRecord:
    """One ``rollout_func`` call: the engine rollout, the version it was asked at and the
    fields TRL received."""

    rollout_id: str
    policy_version: int
    fields: dict[str, list[Any]]


@dataclass
class EngineTRL:
    """The engine on both ends of TRL's ``GRPOTrainer`` (see the module docstring).

    ``model_dir``: the folder the engine's servers started from (its tokenizer and chat
    template go with every published version); ``weights_dir``: where versions are saved
    (``v<step>``). ``request``: extra arguments of every ``RolloutClient.request``.
    """

    client: SyncRolloutClient
    model_dir: Path
    weights_dir: Path
    seed: int = 0
    timeout_s: float = 300.0
    request: dict[str, Any] = field(default_factory=dict)
    version: int = 0
    rollouts: list[RolloutRecord] = field(default_factory=list)

    def rollout_func(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's ``rollout_func``: one engine rollout for this generation batch."""
        training = bool(trainer.model.training)
        group = int(trainer.num_generations if training else trainer.num_generations_eval)
        if group < 1 or len(prompts) % group:
            raise ConfigError(
                f"TRL handed {len(prompts)} prompts, not a multiple of num_generations={group}"
            )
        n_groups = len(prompts) // group
        rid = self.client.request(
            iteration=len(self.rollouts), n_prompts=n_groups, n_samples_per_prompt=group,
            policy_version=self.version, seed=self.seed * 100_003 + len(self.rollouts),
            kind=RolloutKind.TRAIN if training else RolloutKind.EVAL, **self.request,
        )
        _ready, samples = self.client.wait_load(rid, timeout=self.timeout_s)
        pad = trainer.processing_class.pad_token_id
        fields = trl_fields(samples, n_groups=n_groups, group_size=group,
                            pad_token_id=int(pad if pad is not None else 0))
        self.rollouts.append(RolloutRecord(rid, self.version, fields))
        return fields

    def publish(self, model: Any, version: int) -> Path:
        """Save ``model`` as ``weights_dir/v<version>`` and make it the engine's active policy
        version (returns once the syncer reports every server on it)."""
        folder = (self.weights_dir / f"v{version}").resolve()
        staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        for src in self.model_dir.iterdir():  # tokenizer and chat template
            if src.is_file() and src.name not in _NOT_COPIED and not (staging / src.name).exists():
                shutil.copy2(src, staging / src.name)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)  # a server never reads a half-written version
        self.client.publish_version(version, str(folder))
        self.client.wait_version_active(version, timeout=self.timeout_s)
        self.version = version
        return folder

    def callback(self) -> PublishCallback:
        return PublishCallback(self)

    def correct_sampling(self, trainer: Any) -> None:
        """Turn on TRL's importance-sampling correction against the engine's sampler (see the
        module docstring): ``trainer`` takes its vLLM path, the engine as its sampler."""
        if trainer.rollout_func is None:
            raise ConfigError("correct_sampling needs a GRPOTrainer built with rollout_func")
        trainer.use_vllm = True
        trainer.vllm_generation = EngineSampler(self, trainer)
        trainer._last_loaded_step = trainer.state.global_step  # the servers hold these weights


class EngineSampler:
    """TRL's ``vllm_generation`` on the engine: only ``sync_weights`` is called on it when a
    rollout function generates."""

    def __init__(self, bridge: EngineTRL, trainer: Any) -> None:
        self.bridge = bridge
        self.trainer = trainer

    def sync_weights(self) -> None:
        step = int(self.trainer.state.global_step)
        if step != self.bridge.version:
            self.bridge.publish(self.trainer.model, step)


class PublishCallback(TrainerCallback):
    """Publishes the weights after every optimizer step (``EngineTRL.publish``)."""

    def __init__(self, bridge: EngineTRL) -> None:
        self.bridge = bridge

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.bridge.publish(kwargs["model"], int(state.global_step))
