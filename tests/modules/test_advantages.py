import math

import pytest
import torch

from arctic_rl.modules.advantages import group_advantages

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_grpo_normalises_by_unbiased_group_std():
    std = math.sqrt(4 * 0.25 / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(REWARDS, 4, "grpo"), expected)


def test_dr_grpo_subtracts_group_mean_only():
    torch.testing.assert_close(group_advantages(REWARDS, 4, "dr_grpo"), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_rloo_uses_leave_one_out_baseline():
    # sample 0: 1 - mean(0, 0, 1) = 2/3
    torch.testing.assert_close(group_advantages(REWARDS, 4, "rloo"), torch.tensor([2, -2, -2, 2, 0, 0, 0, 0]) / 3)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_give_zero_advantages(estimator):
    assert group_advantages(torch.full((4,), 0.7), 2, estimator).abs().max().item() < 1e-6


def test_nan_reward_is_an_error_naming_the_sample():
    with pytest.raises(ValueError, match=r"samples \[2\]"):
        group_advantages(torch.tensor([1.0, 0.0, float("nan"), 1.0]), 2, "grpo")


def test_group_size_must_divide_and_be_at_least_two():
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(torch.zeros(5), 2, "grpo")
    with pytest.raises(ValueError, match=">= 2"):
        group_advantages(torch.zeros(4), 1, "grpo")
    with pytest.raises(ValueError, match="advantage_estimator"):
        group_advantages(torch.zeros(4), 2, "ppo")


def test_batch_scaling_divides_by_the_whole_batch_std():
    std = REWARDS.double().std().item()  # unbiased, over all 8 rewards
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / (std + 1e-4)
    torch.testing.assert_close(group_advantages(REWARDS, 4, "grpo", scale="batch"), expected)


def test_no_scaling_equals_dr_grpo():
    torch.testing.assert_close(group_advantages(REWARDS, 4, "grpo", scale="none"), group_advantages(REWARDS, 4, "dr_grpo"))
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(REWARDS, 4, "grpo", scale="rank")
