"""The reference losses (``engine.losses``) on tensors whose values are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engine.losses import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    Correction,
    ce_loss,
    group_advantages,
    grpo_loss,
    importance_weights,
    k3,
    k3_loss,
    mismatch_kl,
    mixed_ce_k3_loss,
    proximal_log_probs,
    token_log_probs,
    token_mean,
)


def near(tensor: torch.Tensor | None, expected: list[list[float]]) -> bool:
    assert tensor is not None
    return torch.allclose(tensor, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def leaf(values: list[list[float]]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def test_token_log_probs_line_up_with_the_tokens() -> None:
    # Uniform logits over 2 ids: every token has log(1/2); position 0 has no logit before it.
    logits = torch.zeros(1, 3, 2)
    logits[0, 1] = torch.tensor([0.0, math.log(3.0)])  # predicts tokens[0, 2]: p(1) = 3/4
    tokens = torch.tensor([[1, 0, 1]])
    out = token_log_probs(logits, tokens)
    assert out.shape == (1, 3)
    assert out[0, 0].item() == 0.0
    assert out[0, 1].item() == pytest.approx(math.log(0.5))
    assert out[0, 2].item() == pytest.approx(math.log(0.75))


def test_token_log_probs_normalize_over_the_tokenizer_vocabulary_only() -> None:
    # 2 real ids and 2 spare rows of a padded embedding: with the cut, the spare rows'
    # mass does not lower the real ids' logprobs (what a server that never samples them
    # reports).
    logits = torch.zeros(1, 2, 4)
    tokens = torch.tensor([[0, 1]])
    assert token_log_probs(logits, tokens)[0, 1].item() == pytest.approx(math.log(0.25))
    cut = token_log_probs(logits, tokens, vocab_size=2)
    assert cut[0, 1].item() == pytest.approx(math.log(0.5))
    with pytest.raises(ValueError, match="vocab_size"):
        token_log_probs(logits, tokens, vocab_size=5)


def test_token_mean_divides_by_the_masked_count_and_survives_an_empty_mask() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert token_mean(values, mask).item() == pytest.approx((2 + 3 + 4) / 3)
    x = leaf([[1.0, 2.0]])
    empty = token_mean(x, torch.zeros(1, 2))
    empty.backward()
    assert empty.item() == 0.0
    assert x.grad is not None and torch.equal(x.grad, torch.zeros(1, 2))


def test_group_advantages_normalize_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = group_advantages(rewards, groups)
    std = math.sqrt(0.25 * 0.75)  # population std of one 1 and three 0s
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-4)
    centered = group_advantages(rewards, groups, scale_by_std=False)
    assert centered.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_group_advantages_leave_invalid_rows_out_of_the_statistics() -> None:
    rewards = torch.tensor([1.0, 0.0, 5.0])
    groups = torch.tensor([7, 7, 7])
    adv = group_advantages(rewards, groups, valid=torch.tensor([True, True, False]))
    # mean 0.5 and std 0.5 over the two valid rows; the removed one gets 0
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0], rel=1e-4)


def test_grpo_loss_on_policy_is_minus_the_token_mean_advantage() -> None:
    rollout = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]])
    log_probs = rollout.clone().requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = grpo_loss(log_probs, rollout, torch.tensor([1.0, -1.0]), mask)
    assert out.loss.item() == pytest.approx((-1 - 1 + 1) / 3)
    out.loss.backward()
    # d/ds of -(exp(s - r) * A) at s = r is -A, over 3 tokens; masked positions get nothing
    assert log_probs.grad is not None
    assert near(log_probs.grad, [[0, -1 / 3, -1 / 3], [0, 1 / 3, 0]])
    assert out.metrics["clip_frac"] == 0.0
    assert out.metrics["approx_kl"] == pytest.approx(0.0)
    assert out.metrics["tokens"] == 3.0


def test_grpo_loss_clips_the_ratio_only_where_it_helps_the_objective() -> None:
    rollout = torch.zeros(1, 4)
    # ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1 (per token)
    log_probs = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    out = grpo_loss(log_probs, rollout, adv, torch.ones(1, 4), clip_eps=0.2)
    # per token: -min(1.5, 1.2) = -1.2 | -min(-1.5, -1.2) = 1.5 | -min(0.5, 0.8) = -0.5 |
    # -min(-0.5, -0.8) = 0.8
    assert out.loss.item() == pytest.approx((-1.2 + 1.5 - 0.5 + 0.8) / 4)
    out.loss.backward()
    assert log_probs.grad is not None
    # clipped tokens carry no gradient; the others d/ds = -A * ratio / 4
    assert near(log_probs.grad, [[0.0, 1.5 / 4, -0.5 / 4, 0.0]])
    assert out.metrics["clip_frac"] == pytest.approx(0.5)


def test_grpo_loss_takes_an_asymmetric_upper_clip() -> None:
    log_probs = torch.log(torch.tensor([[1.5]]))
    out = grpo_loss(log_probs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1),
                    clip_eps=0.2, clip_eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.28)


def test_k3_is_the_reverse_kl_estimator_and_its_gradient_pulls_toward_the_teacher() -> None:
    # student 1/2, teacher 1/4 on the sampled token: d = log(1/2), exp(d) - d - 1
    s = torch.log(torch.tensor([[0.5, 0.5, 0.25]])).requires_grad_(True)
    t = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))
    per_token = k3(s, t)
    assert near(per_token, [[0.5 - math.log(0.5) - 1, 0.0, 2.0 - math.log(2.0) - 1]])
    out = k3_loss(s, t, torch.tensor([[1.0, 1.0, 1.0]]))
    assert out.loss.item() == pytest.approx(per_token.sum().item() / 3)
    assert out.metrics["kl"] == pytest.approx(out.loss.item())
    out.loss.backward()
    # d/ds (exp(t - s) - (t - s) - 1) = 1 - exp(t - s): +1/2 (student too high: pushed down),
    # 0 (agree), -1 (student too low: pushed up); over 3 tokens
    assert s.grad is not None
    assert near(s.grad, [[0.5 / 3, 0.0, -1.0 / 3]])


def test_k3_loss_reads_only_the_action_mask() -> None:
    s = leaf([[-1.0, -2.0]])
    t = torch.tensor([[-3.0, -2.0]])
    out = k3_loss(s, t, torch.tensor([[0.0, 1.0]]))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert s.grad is not None and s.grad.tolist() == [[0.0, 0.0]]


def test_mixed_kernel_reads_the_sentinel_sign_per_position() -> None:
    # positions: teacher token (sentinel), student token (K3), prompt (masked), teacher token
    s = torch.log(torch.tensor([[0.5, 0.5, 0.9, 0.25]])).requires_grad_(True)
    teacher = torch.tensor([[1.0, math.log(0.25), -0.1, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    out = mixed_ce_k3_loss(s, teacher, mask)
    ce_0, ce_3 = -math.log(0.5), -math.log(0.25)
    k3_1 = 0.5 - math.log(0.5) - 1
    assert out.loss.item() == pytest.approx((ce_0 + k3_1 + ce_3) / 3, rel=1e-5)
    assert out.metrics["ce"] == pytest.approx((ce_0 + ce_3) / 2, rel=1e-5)
    assert out.metrics["kl"] == pytest.approx(k3_1, rel=1e-5)
    assert (out.metrics["ce_tokens"], out.metrics["k3_tokens"]) == (2.0, 1.0)
    out.loss.backward()
    assert s.grad is not None
    assert near(s.grad, [[-1 / 3, 0.5 / 3, 0.0, -1 / 3]])


def test_mixed_kernel_beta_extremes_reduce_to_ce_and_to_k3() -> None:
    s = torch.log(torch.tensor([[0.5, 0.2, 0.7]]))
    t = torch.log(torch.tensor([[0.3, 0.4, 0.6]]))
    mask = torch.ones(1, 3)
    all_teacher = torch.full((1, 3), 1.0)
    assert mixed_ce_k3_loss(s, all_teacher, mask).loss.item() == pytest.approx(
        ce_loss(s, mask).loss.item()
    )
    assert mixed_ce_k3_loss(s, t, mask).loss.item() == pytest.approx(
        k3_loss(s, t, mask).loss.item()
    )


def test_mixed_kernel_gradient_stays_finite_for_an_unlikely_teacher_token() -> None:
    # exp(1 - (-200)) overflows: the sentinel must never enter K3, not even in the branch
    # torch.where discards, or the gradient turns NaN.
    s = leaf([[-200.0, -1.0]])
    out = mixed_ce_k3_loss(s, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    out.loss.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    assert near(s.grad, [[-0.5, 0.0]])


def test_ce_loss_is_the_masked_negative_log_likelihood() -> None:
    s = leaf([[0.0, math.log(0.5), math.log(0.25)]])
    out = ce_loss(s, torch.tensor([[0.0, 1.0, 1.0]]))
    assert out.loss.item() == pytest.approx((math.log(2) + math.log(4)) / 2)
    out.loss.backward()
    assert s.grad is not None and near(s.grad, [[0.0, -0.5, -0.5]])


@pytest.mark.parametrize(
    "call",
    [
        lambda s: grpo_loss(s, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3)),
        lambda s: grpo_loss(s, torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3)),
        lambda s: k3_loss(s, torch.zeros(2, 2), torch.ones(2, 3)),
        lambda s: mixed_ce_k3_loss(s, torch.zeros(2, 3), torch.ones(3, 3)),
        lambda s: ce_loss(s, torch.ones(1, 3)),
    ],
)
def test_mismatched_shapes_are_refused_with_the_expected_shape(call: object) -> None:
    with pytest.raises(ValueError, match=r"expected \(2, 3\)|rows|\[B\]"):
        call(torch.zeros(2, 3))  # type: ignore[operator]


# Off-policy corrections. Each weight is built from ratios given as exact float32 logs
# (``logs``), so a ratio at a cap or band edge compares equal to the edge. The definitions
# follow verl (verl/trainer/ppo/mismatch_helper.py, compute_rollout_importance_weights),
# slime (examples/train_infer_mismatch_helper/mis.py, compute_mis_weights), TRL's GRPO
# (vllm_importance_sampling_cap) and AReaL (areal/utils/functional.py, ppo_actor_loss_fn).


def logs(ratios: list[list[float]], *, grad: bool = True) -> torch.Tensor:
    return torch.tensor([[math.log(r) for r in row] for row in ratios], requires_grad=grad)


def test_token_tis_truncates_each_weight_at_the_cap_and_keeps_every_token() -> None:
    # sampler logprobs 0, trainer ratios 1, 3, 1/2, 2 (the last one exactly at the cap)
    s = logs([[1.0, 3.0, 0.5, 2.0]])
    out = grpo_loss(s, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4),
                    correction=Correction("tis", cap=2.0))
    # the PPO ratio is anchored at the trainer's own logprobs (1 at the first step): each
    # token's term is -min(r, 2) * A
    assert out.loss.item() == pytest.approx(-(1 + 2 + 0.5 + 2) / 4)
    out.loss.backward()
    assert near(s.grad, [[-1 / 4, -2 / 4, -0.5 / 4, -2 / 4]])  # the weight is detached
    assert out.metrics["is_truncated"] == pytest.approx(1 / 4)  # 3 only: 2 is at the cap
    assert out.metrics["is_masked"] == 0.0
    assert out.metrics["is_ess"] == pytest.approx(5.5**2 / (4 * 9.25))  # w = 1, 2, 1/2, 2
    kl = [r - math.log(r) - 1 for r in (1.0, 3.0, 0.5, 2.0)]  # K3 of KL(sampler || trainer)
    assert out.metrics["mismatch_kl"] == pytest.approx(sum(kl) / 4, rel=1e-5)


def test_sequence_tis_weights_every_token_by_its_sequence_product_over_the_mask() -> None:
    # position 0 is the prompt (masked): its ratio 20 takes no part in the product
    s = logs([[20.0, 2.0, 2.0], [20.0, 0.5, 1.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    out = grpo_loss(s, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask,
                    correction=Correction("tis", level="sequence", cap=2.0))
    # row 0: product 4 -> truncated to 2, A = +1: -2 per token; row 1: 0.75, A = -1: +0.75
    assert out.loss.item() == pytest.approx((-2 - 2 + 0.75 + 0.75) / 4)
    out.loss.backward()
    assert near(s.grad, [[0.0, -2 / 4, -2 / 4], [0.0, 0.75 / 4, 0.75 / 4]])
    assert out.metrics["is_truncated"] == pytest.approx(2 / 4)  # row 0's two tokens


def test_token_mis_takes_tokens_over_the_cap_out_of_the_loss() -> None:
    s = logs([[1.0, 3.0, 0.5, 2.0]])
    out = grpo_loss(s, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4),
                    correction=Correction("mis", cap=2.0))
    # 3 > 2 leaves the loss (numerator and denominator); the others keep their own ratio
    assert out.loss.item() == pytest.approx(-(1 + 0.5 + 2) / 3)
    out.loss.backward()
    assert near(s.grad, [[-1 / 3, 0.0, -0.5 / 3, -2 / 3]])
    assert out.metrics["is_masked"] == pytest.approx(1 / 4)
    assert out.metrics["is_truncated"] == 0.0
    assert out.metrics["is_ess"] == pytest.approx(3.5**2 / (4 * 5.25))  # w = 1, 0, 1/2, 2


def test_sequence_mis_drops_a_whole_sequence_whose_product_exceeds_the_cap() -> None:
    s = logs([[2.0, 2.0], [0.5, 1.5]])
    out = grpo_loss(s, torch.zeros(2, 2), torch.tensor([1.0, -1.0]), torch.ones(2, 2),
                    correction=Correction("mis", level="sequence", cap=2.0))
    # row 0 (product 4) is gone; row 1 keeps weight 0.75 with A = -1
    assert out.loss.item() == pytest.approx(0.75)
    out.loss.backward()
    assert near(s.grad, [[0.0, 0.0], [0.75 / 2, 0.75 / 2]])
    assert out.metrics["is_masked"] == pytest.approx(0.5)


def test_icepop_keeps_the_band_edges_and_masks_what_lies_outside() -> None:
    s = logs([[0.5, 5.0, 0.49, 5.1, 1.0]])
    iw = importance_weights(s, torch.zeros(1, 5), torch.ones(1, 5),
                            Correction("icepop", band=(0.5, 5.0)))
    assert iw.keep.tolist() == [[1.0, 1.0, 0.0, 0.0, 1.0]]
    assert near(iw.weights, [[0.5, 5.0, 0.0, 0.0, 1.0]])
    out = grpo_loss(s, torch.zeros(1, 5), torch.tensor([1.0]), torch.ones(1, 5),
                    correction=Correction("icepop", band=(0.5, 5.0)))
    assert out.loss.item() == pytest.approx(-(0.5 + 5.0 + 1.0) / 3)
    out.loss.backward()
    assert near(s.grad, [[-0.5 / 3, -5.0 / 3, 0.0, 0.0, -1.0 / 3]])
    assert out.metrics["is_masked"] == pytest.approx(2 / 5)


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_every_correction_reduces_to_the_plain_loss_when_trainer_and_sampler_agree(
    mode: str, level: str
) -> None:
    rollout = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    plain_s = rollout.clone().requires_grad_(True)
    plain = grpo_loss(plain_s, rollout, adv, mask)
    plain.loss.backward()
    s = rollout.clone().requires_grad_(True)
    out = grpo_loss(s, rollout, adv, mask, correction=Correction(mode, level=level))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(plain.loss.item())
    assert s.grad is not None and plain_s.grad is not None
    assert torch.allclose(s.grad, plain_s.grad)
    assert (out.metrics["is_ess"], out.metrics["mismatch_kl"]) == (1.0, 0.0)
    assert (out.metrics["is_truncated"], out.metrics["is_masked"]) == (0.0, 0.0)


def test_proximal_log_probs_take_the_rollout_value_where_the_version_is_the_proximal_one() -> None:
    recomputed = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.5, -2.5, -3.5]])
    versions = torch.tensor([[3, 2, -1]])  # at the proximal version, older, unknown
    prox = proximal_log_probs(recomputed, rollout, versions, 3)
    assert prox.tolist() == [[-1.5, -2.0, -3.0]]


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weights_by_behaviour() -> None:
    # t0 sampled at the proximal version (proximal = rollout, weight 1), trainer ratio 1.5;
    # t1, t2 sampled by older weights: proximal/behaviour ratios 2 and 4 (cap 3), trainer
    # ratios to the proximal 1 and 1/2.
    rollout = torch.zeros(1, 3)
    recomputed = logs([[1.3, 2.0, 4.0]], grad=False)  # t0's value is replaced by the rollout's
    prox = proximal_log_probs(recomputed, rollout, torch.tensor([[5, 4, 4]]), 5)
    s = logs([[1.5, 2.0, 2.0]])
    out = grpo_loss(s, rollout, torch.tensor([1.0]), torch.ones(1, 3), clip_eps=0.2,
                    correction=Correction("tis", cap=3.0), proximal=prox)
    # t0: -min(1.5, 1.2) * 1 = -1.2 (clipped: no gradient); t1: -1 * 2; t2: -min(0.5, 0.8) * 3
    assert out.loss.item() == pytest.approx((-1.2 - 2.0 - 1.5) / 3)
    out.loss.backward()
    assert near(s.grad, [[0.0, -2.0 / 3, -1.5 / 3]])  # d/ds = -A * ratio * w on t1, t2
    assert out.metrics["clip_frac"] == pytest.approx(1 / 3)
    assert out.metrics["is_truncated"] == pytest.approx(1 / 3)
    # Anchored at the rollout instead (plain PPO), t1's ratio 2 would have been clipped.
    assert grpo_loss(s, rollout, torch.tensor([1.0]), torch.ones(1, 3)).metrics[
        "clip_frac"] == pytest.approx(1.0)


def test_decoupled_ppo_without_a_correction_keeps_the_whole_behaviour_weight() -> None:
    rollout = torch.zeros(1, 1)
    prox = logs([[4.0]], grad=False)
    s = prox.clone().requires_grad_(True)
    out = grpo_loss(s, rollout, torch.tensor([1.0]), torch.ones(1, 1), proximal=prox)
    assert out.loss.item() == pytest.approx(-4.0)
    assert out.metrics["is_truncated"] == 0.0


def test_mismatch_kl_is_the_k3_estimate_on_the_sampled_tokens() -> None:
    trainer = logs([[0.5, 2.0]], grad=False)
    assert mismatch_kl(trainer, torch.zeros(1, 2), torch.tensor([[1.0, 0.0]])) == pytest.approx(
        0.5 - math.log(0.5) - 1
    )


def test_the_effective_sample_size_of_one_dominant_weight_tends_to_one_over_n() -> None:
    s = logs([[1e3, 1e-3, 1e-3, 1e-3]], grad=False)
    iw = importance_weights(s, torch.zeros(1, 4), torch.ones(1, 4), Correction())
    w = [1e3, 1e-3, 1e-3, 1e-3]
    assert iw.metrics["is_ess"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))
    assert iw.metrics["is_ess"] == pytest.approx(0.25, rel=1e-4)
    empty = importance_weights(s, torch.zeros(1, 4), torch.zeros(1, 4), Correction("mis"))
    assert empty.metrics == {"is_ess": 1.0, "is_truncated": 0.0, "is_masked": 0.0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "clip"}, "correction mode"),
        ({"level": "geometric"}, "correction level"),
        ({"cap": 0.5}, "cap must be"),
        ({"band": (1.2, 5.0)}, "band must"),
        ({"band": (0.5, 0.9)}, "band must"),
    ],
)
def test_a_correction_that_would_cut_on_policy_tokens_is_refused(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        Correction(**kwargs)  # type: ignore[arg-type]


def test_the_trl_style_adapter_calls_the_corrections_on_the_response_layout() -> None:
    from docs.examples.trainer_adapters import (
        TRL_IMPORTANCE_SAMPLING_MODES,
        off_policy_grpo_loss,
        split_prompt_response,
    )
    from engine.client import collate
    from engine.sample import Sample

    sample = Sample(index=0, group_index=0, tokens=[5, 6, 7, 8], response_length=2,
                    loss_mask=[1, 1], rollout_log_probs=[0.0, 0.0], token_versions=[3, 2])
    parts = split_prompt_response(collate([sample]))
    assert parts["response_versions"].tolist() == [[3, 2]]
    old = logs([[1.5, 4.0]], grad=False)  # the trainer before the update: ratios 1.5 and 4
    s = old.clone().requires_grad_(True)
    out = off_policy_grpo_loss(s, old, parts["response_log_probs"], torch.tensor([1.0]),
                               parts["response_mask"],
                               correction=TRL_IMPORTANCE_SAMPLING_MODES["token_truncate"],
                               versions=parts["response_versions"], proximal_version=3)
    # token 0 was sampled at the proximal version: proximal = sampler, the trainer's ratio
    # 1.5 is clipped to 1.2 with weight 1; token 1: ratio 1 to the proximal, weight min(4, 2)
    assert out.loss.item() == pytest.approx(-(1.2 + 2.0) / 2)
