"""The reference losses (``engine.losses``) on tensors whose values are worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engine.losses import (
    ce_loss,
    group_advantages,
    grpo_loss,
    k3,
    k3_loss,
    mixed_ce_k3_loss,
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
