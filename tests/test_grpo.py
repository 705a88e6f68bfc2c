"""The GRPO learning signal: group advantages, equal-reward groups, the PPO-clip loss and its
aggregations, the server/trainer mismatch metrics, mini-batch rows and merged stats (lib/grpo.py)."""
import math

import pytest
import torch

from lib.grpo import (MISMATCH_CAPPED_WARN, MISMATCH_KL_WARN, equal_reward_groups, grpo_advantages, logprob_mismatch,
                      merge_stats, minibatch_rows, mismatch_warning, ppo_loss)


def test_logprob_mismatch_compares_only_generated_tokens_and_reports_weights_and_k3_kl():
    trainer = torch.tensor([[0.0, -1.0, -2.0, -9.0]])
    server = torch.tensor([[0.0, -1.5, -1.9, 0.0]])
    m = logprob_mismatch(trainer, server, torch.tensor([[0, 1, 1, 0]]), behaviour_weight_cap=1.5)
    assert m["server_trainer_abs_diff_mean"] == pytest.approx(0.3) and m["server_trainer_abs_diff_max"] == pytest.approx(0.5)
    weights = [math.exp(0.5), math.exp(-0.1)]
    assert m["behaviour_weight_mean"] == pytest.approx(sum(weights) / 2)
    assert m["behaviour_weight_max"] == pytest.approx(math.exp(0.5))
    assert m["behaviour_capped_fraction"] == pytest.approx(0.5)  # e^0.5 = 1.65 > 1.5
    k3 = [w - 1 - d for w, d in zip(weights, [0.5, -0.1])]
    assert m["mismatch_kl_k3"] == pytest.approx(sum(k3) / 2)


# --- advantages ---

def test_grpo_advantages_are_group_normalised_with_sample_std():
    # group 1: mean 0.25, sample std 0.5; group 2: mean 0.5, sample std sqrt(1/3)
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4, eps=0.0)
    s = math.sqrt(1 / 3)
    assert adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s], abs=1e-6)


def test_dr_grpo_advantages_only_subtract_the_group_mean():
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]), 4, scale_by_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])


def test_a_group_with_equal_rewards_has_zero_advantage():
    assert grpo_advantages(torch.tensor([0.7, 0.7, 0.7]), 3).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("rewards", [
    torch.tensor([3e38, -3e38, 3e38, 0.0], dtype=torch.float32),  # float32's largest: their squares are not
    torch.tensor([1.5e308, 1.5e308, -1.5e308, 0.0], dtype=torch.float64),  # their sum overflows float64
    torch.tensor([1e200, -1e200, 1e200, 0.0], dtype=torch.float64),  # their squares overflow float64
])
def test_finite_rewards_of_any_size_give_the_advantages_of_the_same_rewards_scaled_down(rewards):
    adv = grpo_advantages(rewards, 4, eps=0.0)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all()
    small = grpo_advantages(rewards / rewards.abs().max(), 4, eps=0.0)
    assert adv.tolist() == pytest.approx(small.tolist(), rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e39])  # 1e39: inf in float32
def test_a_reward_that_is_not_a_finite_float32_is_a_value_error_naming_its_group(bad):
    rewards = torch.tensor([0.0, 1.0, 1.0, bad], dtype=torch.float32)
    with pytest.raises(ValueError, match=r"group 1 \(rows 2-3\).*finite"):
        grpo_advantages(rewards, 2)


def test_without_std_scaling_advantages_past_float32s_range_are_a_value_error_naming_the_group():
    rewards = torch.tensor([0.0, 1.0, 1e39, -1e39], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"group 1 \(rows 2-3\).*float32"):
        grpo_advantages(rewards, 2, scale_by_std=False)


def test_equal_reward_groups_marks_every_row_of_an_all_equal_group():
    mask = equal_reward_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2)
    assert mask.tolist() == [True, True, False, False, True, True]


@pytest.mark.parametrize("value", [0.9, 2 / 3, 0.4, 0.1 + 0.2, 1e-3, 123.456])
@pytest.mark.parametrize("scale_by_std", [True, False])
def test_equal_float_rewards_give_exactly_zero_advantage_in_groups_of_eight(value, scale_by_std):
    """float32 noise used to give such groups |A| ~ 0.06, every row of one sign."""
    rewards = torch.tensor([value] * 8 + [0.0, 1.0] * 4, dtype=torch.float32)
    adv = grpo_advantages(rewards, 8, scale_by_std=scale_by_std)
    assert adv[:8].tolist() == [0.0] * 8
    assert adv[8:].abs().min().item() > 0.4  # the mixed group keeps its signal
    assert equal_reward_groups(rewards, 8).tolist() == [True] * 8 + [False] * 8


def test_rewards_equal_up_to_rounding_are_one_reward():
    rewards = torch.tensor([0.1 + 0.2, 0.3, 0.3, 0.30000001], dtype=torch.float64)
    assert equal_reward_groups(rewards, 4).all() and grpo_advantages(rewards, 4).abs().max().item() == 0.0


@pytest.mark.parametrize("num_rows,num_minibatches", [(5, 4), (7, 3), (3, 3), (10, 1), (9, 8)])
def test_minibatch_rows_gives_exactly_the_asked_number_of_nonempty_disjoint_parts(num_rows, num_minibatches):
    parts = minibatch_rows(num_rows, num_minibatches, seed=0)
    assert len(parts) == num_minibatches and all(len(p) > 0 for p in parts)
    assert sorted(torch.cat(parts).tolist()) == list(range(num_rows))


def test_stats_of_minibatches_merge_when_one_had_no_loss_tokens():
    """A mini-batch whose rows generated nothing has only num_tokens in its loss stats; merging by
    the first mini-batch's keys raised KeyError."""
    merged = merge_stats([{"num_tokens": 0, "loss": 0.0, "grad_norm": 0.0},
                          {"num_tokens": 4, "loss": 1.0, "grad_norm": 2.0, "clip_fraction": 0.5, "approx_kl_max": 0.1}])
    assert merged["num_tokens"] == 4 and merged["clip_fraction"] == 0.5 and merged["approx_kl_max"] == 0.1


def test_merged_stats_add_up_the_updates_skipped_for_non_finite_gradients():
    merged = merge_stats([{"num_tokens": 3, "nonfinite_grad_steps": 1.0},
                          {"num_tokens": 5, "nonfinite_grad_steps": 0.0},
                          {"num_tokens": 0, "nonfinite_grad_steps": 1.0}])
    assert merged["nonfinite_grad_steps"] == 2.0


def test_every_rank_gets_the_same_minibatch_count_for_uneven_rows():
    """The training loop's rule: count = min(ppo_minibatches, rows // world_size); rank r holds
    rows r, r + W, ... of the batch. torch.chunk(5 rows, 4) gave 3 parts on one rank, 4 on another."""
    for total in range(2, 40):
        for world_size in (1, 2, 3, 4):
            if total < world_size:
                continue
            count = max(1, min(4, total // world_size))
            counts = {len(minibatch_rows(len(range(r, total, world_size)), count, seed=1)) for r in range(world_size)}
            assert counts == {count}


# --- loss ---

def two_token_case():
    """Two sequences of [prompt, generated]. Generated token of row 0: A = +1, ratio 1.5 (past
    1 + eps_high = 1.28), behaviour weight 2. Row 1: A = -1, ratio 0.5 (below 1 - eps_low = 0.8),
    behaviour weight 1."""
    proximal = torch.tensor([[0.0, -1.0], [0.0, -2.0]])
    logprobs = (proximal + torch.tensor([[0.0, math.log(1.5)], [0.0, math.log(0.5)]])).requires_grad_()
    behaviour = proximal - torch.tensor([[0.0, math.log(2.0)], [0.0, 0.0]])
    return logprobs, proximal, behaviour, torch.tensor([1.0, -1.0]), torch.tensor([[0, 1], [0, 1]])


def test_ppo_loss_clips_high_and_low_and_weights_by_behaviour_ratio():
    logprobs, proximal, behaviour, adv, mask = two_token_case()
    loss, stats = ppo_loss(logprobs, proximal, behaviour, adv, mask)
    # row 0: max(-1.5, -1.28) * 2 = -2.56; row 1: max(0.5, 0.8) * 1 = 0.8; token mean over 2 tokens
    assert loss.item() == pytest.approx((-2.56 + 0.8) / 2)
    assert stats["clip_fraction"] == 1.0
    assert stats["behaviour_weight_mean"] == pytest.approx(1.5)
    assert stats["behaviour_weight_max"] == pytest.approx(2.0)
    assert stats["num_tokens"] == 2
    loss.backward()
    assert logprobs.grad.abs().max().item() == 0.0  # both tokens clipped: no gradient


def test_ppo_loss_gradient_inside_the_clip_range_is_minus_advantage_times_ratio():
    proximal = torch.tensor([[0.0, -1.0]])
    logprobs = (proximal + torch.tensor([[0.0, math.log(1.1)]])).requires_grad_()
    loss, stats = ppo_loss(logprobs, proximal, proximal, torch.tensor([2.0]), torch.tensor([[0, 1]]))
    assert loss.item() == pytest.approx(-2.2)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -2.2])  # d(-A·exp(lp - prox))/dlp
    assert stats["clip_fraction"] == 0.0


def test_ppo_loss_masks_tokens_whose_behaviour_weight_exceeds_the_cap():
    logprobs, proximal, behaviour, adv, mask = two_token_case()
    loss, stats = ppo_loss(logprobs, proximal, behaviour, adv, mask, behaviour_weight_cap=1.5,
                           behaviour_cap_mode="mask")
    assert loss.item() == pytest.approx((0.0 + 0.8) / 2)  # row 0 dropped, still in the denominator
    assert stats["behaviour_capped_fraction"] == 0.5


def test_ppo_loss_truncates_the_behaviour_weight_at_the_cap_by_default():
    logprobs, proximal, behaviour, adv, mask = two_token_case()
    loss, stats = ppo_loss(logprobs, proximal, behaviour, adv, mask, behaviour_weight_cap=1.5)
    # row 0: max(-1.5, -1.28) * min(2, 1.5) = -1.92; row 1 unchanged (weight 1)
    assert loss.item() == pytest.approx((-1.92 + 0.8) / 2)
    assert stats["behaviour_capped_fraction"] == 0.5 and stats["behaviour_weight_max"] == pytest.approx(2.0)


def test_ppo_loss_gradient_of_a_capped_token_is_bounded_by_the_cap():
    proximal = torch.tensor([[0.0, -1.0]])
    logprobs = proximal.clone().requires_grad_()
    behaviour = proximal - 3.0  # weight e^3 = 20
    loss, _ = ppo_loss(logprobs, proximal, behaviour, torch.tensor([1.0]), torch.tensor([[0, 1]]),
                       behaviour_weight_cap=2.0)
    loss.backward()
    assert logprobs.grad[0, 1].item() == pytest.approx(-2.0)  # -A * ratio(1) * cap


def test_ppo_loss_adds_k3_kl_to_the_reference():
    proximal = torch.tensor([[0.0, -1.0]])
    ref = proximal + math.log(2.0)  # k3 = 2 - ln 2 - 1
    loss, stats = ppo_loss(proximal.clone(), proximal, proximal, torch.tensor([0.0]), torch.tensor([[0, 1]]),
                           ref_logprobs=ref, kl_coef=0.1)
    assert stats["kl_ref"] == pytest.approx(1 - math.log(2))
    assert loss.item() == pytest.approx(0.1 * (1 - math.log(2)))


def test_seq_mean_token_sum_norm_divides_by_a_constant_per_sequence_as_dr_grpo_does():
    # the same rows as below; Dr. GRPO: the token sum over (2 sequences x the constant 8)
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = ppo_loss(lp, lp, lp, adv, mask, agg="seq-mean-token-sum-norm", norm_tokens=8)
    assert loss.item() == pytest.approx((-1 + 3) / (2 * 8))
    longer, _ = ppo_loss(torch.zeros(2, 6), torch.zeros(2, 6), torch.zeros(2, 6), adv,
                         torch.tensor([[0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1]]), agg="seq-mean-token-sum-norm",
                         norm_tokens=8)
    assert longer.item() == pytest.approx((-1 + 5) / (2 * 8))  # a longer answer: more tokens, same weight each
    with pytest.raises(ValueError, match="norm_tokens"):
        ppo_loss(lp, lp, lp, adv, mask, agg="seq-mean-token-sum-norm")


def test_in_mask_mode_a_token_over_the_cap_is_out_of_the_kl_term_too():
    proximal = torch.tensor([[0.0, -1.0, -1.0]])
    behaviour = torch.tensor([[0.0, -1.0, -3.0]])  # the last token's behaviour weight e^2 > cap 2
    ref = proximal + math.log(2.0)
    mask = torch.tensor([[0, 1, 1]])
    masked, _ = ppo_loss(proximal.clone(), proximal, behaviour, torch.tensor([0.0]), mask, ref_logprobs=ref,
                         kl_coef=0.1, behaviour_weight_cap=2.0, behaviour_cap_mode="mask")
    truncated, _ = ppo_loss(proximal.clone(), proximal, behaviour, torch.tensor([0.0]), mask, ref_logprobs=ref,
                            kl_coef=0.1, behaviour_weight_cap=2.0, behaviour_cap_mode="truncate")
    k3 = 1 - math.log(2)
    assert masked.item() == pytest.approx(0.1 * k3 / 2)  # one kept token's KL over the 2 loss tokens
    assert truncated.item() == pytest.approx(0.1 * k3)


def test_seq_mean_token_mean_weights_each_sequence_equally():
    # row 0: one token with per-token loss -A = -1; row 1: three tokens with -A = +1 each.
    lp = torch.zeros(2, 4)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    token_mean, _ = ppo_loss(lp, lp, lp, adv, mask, agg="token-mean")
    seq_mean, _ = ppo_loss(lp, lp, lp, adv, mask, agg="seq-mean-token-mean")
    assert token_mean.item() == pytest.approx((-1 + 3) / 4)
    assert seq_mean.item() == pytest.approx((-1 + 1) / 2)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_row_weights_of_one_over_k_make_an_episode_of_k_rows_count_once_in_the_per_sequence_losses(agg):
    # rows 0 and 1: one episode's two segments (A = 1); row 2: another episode's one row (A = -1)
    lp = torch.zeros(3, 4)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    kw = {"agg": agg, "norm_tokens": 8}
    unweighted, _ = ppo_loss(lp, lp, lp, adv, mask, **kw)
    weighted, _ = ppo_loss(lp, lp, lp, adv, mask, row_weights=torch.tensor([0.5, 0.5, 1.0]), **kw)
    if agg == "seq-mean-token-mean":  # per row its token mean of -A; sequences counted by their weights
        assert unweighted.item() == pytest.approx((-1 - 1 + 1) / 3)  # the two-segment episode weighs twice
        assert weighted.item() == pytest.approx((0.5 * -1 + 0.5 * -1 + 1) / 2)  # each episode once: 0
    else:  # per row its token sum of -A over the constant 8
        assert unweighted.item() == pytest.approx((-1 - 2 + 3) / (3 * 8))
        assert weighted.item() == pytest.approx((0.5 * -1 + 0.5 * -2 + 3) / (2 * 8))
    ones, _ = ppo_loss(lp, lp, lp, adv, mask, row_weights=torch.ones(3), **kw)
    assert ones.item() == pytest.approx(unweighted.item())  # weights of 1 change nothing


def test_token_mean_ignores_row_weights_every_token_weighs_alike():
    lp = torch.zeros(3, 4)
    mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 1, 1]])
    adv = torch.tensor([1.0, 1.0, -1.0])
    plain, _ = ppo_loss(lp, lp, lp, adv, mask, agg="token-mean")
    weighted, _ = ppo_loss(lp, lp, lp, adv, mask, agg="token-mean", row_weights=torch.tensor([0.5, 0.5, 1.0]))
    assert weighted.item() == plain.item() == pytest.approx((-3 + 3) / 6)


def test_a_mismatch_past_the_documented_thresholds_gives_a_warning_and_bf16_noise_does_not():
    assert mismatch_warning({"mismatch_kl_k3": 0.0018, "behaviour_capped_fraction": 0.0002}) is None
    assert mismatch_warning({}) is None
    warning = mismatch_warning({"mismatch_kl_k3": 2 * MISMATCH_KL_WARN, "behaviour_capped_fraction": 0.0})
    assert warning and "k3 KL 0.0200" in warning
    assert mismatch_warning({"mismatch_kl_k3": 0.0, "behaviour_capped_fraction": 2 * MISMATCH_CAPPED_WARN})
    # a real mismatch: the trainer's log-probs one nat off on every token
    lp = torch.full((2, 5), -2.0)
    assert mismatch_warning(logprob_mismatch(lp - 1.0, lp, torch.ones(2, 5), behaviour_weight_cap=2.0))
