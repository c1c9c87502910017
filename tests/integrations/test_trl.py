"""TRL's GRPOTrainer on engine rollouts (integrations.trl).

Shapes relied on, from TRL 1.16's ``trl/trainer/grpo_trainer.py``: ``GRPOTrainer._generate``
calls ``rollout_func(prompts, trainer)`` and requires ``prompt_ids`` / ``completion_ids`` /
``logprobs``, pops ``env_mask`` as the tool mask and forwards every other key to the reward
functions (``_generate_and_score_completions``, "Merge extra_fields"); the loss mask is
``completion_mask * tool_mask``; ``old_per_token_logps`` is TRL's own logprob of each
completion token under the model that sampled it, computed when generation and optimizer
steps are misaligned (``gradient_accumulation_steps % (steps_per_generation *
num_iterations) != 0``), and ``sampling_per_token_logps`` is the rollout function's
``logprobs`` padded; on the vLLM path (``use_vllm`` with ``vllm_importance_sampling_correction``,
which ``EngineTRL.correct_sampling`` turns on) ``importance_sampling_ratio`` is
``exp(old - sampling)``, summed per sequence in the default ``sequence_mask`` mode, and
``_generate`` calls ``vllm_generation.sync_weights()`` when the step changed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import ConfigError, RolloutError
from engine.sample import Sample
from integrations.trl import SPARE_LOGIT, cut_spare_logits, engine_reward, trl_fields
from tests.integrations.conftest import need, tool_episode


def test_a_multi_turn_tool_episode_reaches_trl_with_its_mask_logprobs_and_reward() -> None:
    episodes = [tool_episode(1, 0, reward=0.0), tool_episode(0, 0), tool_episode(2, 1)]
    dummy = Sample.masked_dummy(policy_version=3).model_copy(
        update={"index": 3, "group_index": 1})
    out = trl_fields([*episodes, dummy], n_groups=2, group_size=2, pad_token_id=0)
    # Groups in a row, each by index: TRL's advantages take runs of num_generations.
    assert out["sample_id"] == ["r:s0", "r:s1", "r:s2", ""]
    assert out["prompt_ids"][0] == [11, 12, 13]
    # The whole multi-turn response is the completion; the tool output is masked off.
    assert out["completion_ids"][0] == [20, 21, 30, 31, 32, 22, 23]
    assert out["env_mask"][0] == [1, 1, 0, 0, 0, 1, 1]
    assert out["logprobs"][0] == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.5, -0.125]
    assert out["token_versions"][0] == [3, 3, -1, -1, -1, 3, 3]
    assert out["policy_version"] == [3, 3, 3, 3]
    # The removed sample: masked, with a pad prompt, and no reward (out of TRL's baseline).
    assert out["prompt_ids"][3] == [0] and out["env_mask"][3] == [0, 0]
    assert out["engine_reward"] == [1.0, 0.0, 1.0, None]
    assert engine_reward([], [], engine_reward=out["engine_reward"]) == out["engine_reward"]


def test_a_rollout_that_does_not_fill_trl_groups_is_refused_by_name() -> None:
    with pytest.raises(RolloutError, match=r"2 groups of 2 samples.*sizes \[1, 2\]"):
        trl_fields([tool_episode(0, 0), tool_episode(1, 0), tool_episode(2, 1)],
                   n_groups=2, group_size=2, pad_token_id=0)
    bare = tool_episode(0, 0).model_copy(update={"rollout_log_probs": None})
    with pytest.raises(RolloutError, match="no rollout_log_probs"):
        trl_fields([bare], n_groups=1, group_size=1, pad_token_id=0)


def test_cut_spare_logits_normalizes_over_the_tokenizer_ids_and_saves_nothing() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    tokens = torch.tensor([[1, 5, 9, 3]])
    before = model(tokens).logits
    cut_spare_logits(model, 12)
    after = torch.log_softmax(model(tokens).logits, dim=-1)
    assert torch.allclose(after[..., :12], torch.log_softmax(before[..., :12], dim=-1),
                          atol=1e-6)
    assert float(after[..., 12:].exp().max()) == 0.0 and SPARE_LOGIT < -1e6
    assert "lm_head.bias" not in model.state_dict()  # the published weights are the model's
    assert not any(p is model.lm_head.bias for p in model.parameters())  # never trained
    with pytest.raises(ConfigError, match=r"vocab_size must be in \[1, 16\]"):
        cut_spare_logits(model, 17)


@pytest.mark.slow
@pytest.mark.redis_server
def test_grpo_trainer_trains_on_engine_rollouts_and_publishes_each_step(
    tmp_path: Path, math_model_dir: Path,
) -> None:
    need("trl", "trl")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from engine.client import SyncRolloutClient
    from integrations.trl import EngineTRL, placeholder_dataset
    from trainer.stack import start_stack

    class Recording(GRPOTrainer):  # type: ignore[misc]
        """Keeps what each generation batch handed to the loss."""

        batches: list[dict[str, Any]] = []

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            self.batches.append(out)
            return out

    # The math agent's episode, overfit: its samples call the python tool, so the episodes
    # are multi-turn with tool output in the response.
    student = math_model_dir
    stack = start_stack(tmp_path / "run", student_dir=student, teacher_dir=None)
    try:
        client = SyncRolloutClient(stack.trainer_url, block_ms=200, producer="trl")
        bridge = EngineTRL(client, model_dir=student, weights_dir=tmp_path / "weights",
                           request={"datasets": ["math_train"]}, timeout_s=120)
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"), per_device_train_batch_size=4, num_generations=2,
            gradient_accumulation_steps=1, num_iterations=2, max_steps=3, learning_rate=1e-3,
            temperature=1.0, use_cpu=True, bf16=False, report_to=[], logging_steps=1,
            save_strategy="no", seed=0, dataloader_num_workers=0,
        )
        model = AutoModelForCausalLM.from_pretrained(student)
        tokenizer = AutoTokenizer.from_pretrained(student)
        cut_spare_logits(model, len(tokenizer))
        trainer = Recording(
            model=model, processing_class=tokenizer,
            reward_funcs=engine_reward, args=args, train_dataset=placeholder_dataset(16),
            rollout_func=bridge.rollout_func, callbacks=[bridge.callback()],
        )
        bridge.correct_sampling(trainer)
        trainer.train()
        activated = client.wait_version_active(3, timeout=30)
        client.close()
    finally:
        stack.stop()

    # Two generation batches (num_iterations=2 reuses each for two steps), three steps, each
    # published: the second rollout was asked at, and sampled by, version 2.
    assert [r.policy_version for r in bridge.rollouts] == [0, 2]
    assert activated.version == 3 and bridge.version == 3
    for record in bridge.rollouts:
        assert set(record.fields["policy_version"]) == {record.policy_version}
        for versions, mask in zip(record.fields["token_versions"], record.fields["env_mask"],
                                  strict=True):
            assert {v for v, m in zip(versions, mask, strict=True) if m} <= {
                record.policy_version}
    # Multi-turn tool episodes reached TRL: model tokens, masked tool output, model tokens.
    masks = ["".join(map(str, m)) for r in bridge.rollouts for m in r.fields["env_mask"]]
    assert any(re.search("1+0+1", m) for m in masks)
    assert len(Recording.batches) == 2
    for record, batch in zip(bridge.rollouts, Recording.batches, strict=True):
        fields = record.fields
        n = len(fields["completion_ids"])
        width = batch["completion_ids"].shape[1]
        # The engine's loss masks reach TRL unchanged (its tool mask, right-padded).
        for i in range(n):
            k = len(fields["completion_ids"][i])
            assert batch["completion_ids"][i, :k].tolist() == fields["completion_ids"][i]
            assert batch["tool_mask"][i, :k].tolist() == fields["env_mask"][i]
        # TRL's logprobs of the sampled tokens equal the engine's on every trained token.
        trained = (batch["completion_mask"] * batch["tool_mask"]).bool()
        assert trained.any() and width >= max(len(c) for c in fields["completion_ids"])
        diff = (batch["old_per_token_logps"] - batch["sampling_per_token_logps"]).abs()
        assert float(diff[trained].max()) < 1e-4
        # TRL's importance-sampling correction ran against the engine's sampler: its ratio
        # (per sequence, the default mode) is 1 within the same error.
        ratio = batch["importance_sampling_ratio"]
        assert ratio.shape == (n, 1) and float((ratio - 1).abs().max()) < 1e-3
        sampled = [x for lp, m in zip(fields["logprobs"], fields["env_mask"], strict=True)
                   for x, b in zip(lp, m, strict=True) if b]
        assert torch.equal(batch["sampling_per_token_logps"][trained], torch.tensor(sampled))
