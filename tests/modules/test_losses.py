"""Loss math against hand-computed values."""

import math

import pytest
import torch

from arctic_rl.modules.losses import (
    LossNormalizer,
    aggregate_loss,
    clipped_surrogate,
    importance_log_ratio,
    kl_penalty,
    masked_mean,
)


@pytest.mark.parametrize(
    "estimator,expected",
    [
        ("k1", [0.5, -1.0]),
        ("k2", [0.125, 0.5]),
        ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_kl_estimators_match_hand_values(estimator, expected):
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, estimator), torch.tensor([expected]))


def test_kl_unknown_estimator_names_the_field():
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


RATIOS = torch.tensor([0.5, 1.0, 1.5, 3.0])


def test_clipped_surrogate_positive_and_negative_advantages():
    log_ratio = RATIOS.log().repeat(2, 1)
    terms = clipped_surrogate(log_ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 4), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(terms.loss, torch.tensor([[-0.5, -1.0, -1.2, -1.2], [0.8, 1.0, 1.5, 3.0]]))
    assert terms.clipped_high.tolist() == [[False, False, True, True], [False] * 4]
    assert terms.clipped_low.tolist() == [[False] * 4, [True, False, False, False]]
    assert not terms.dual_clipped.any()


def test_clip_higher_is_asymmetric():
    terms = clipped_surrogate(RATIOS.log()[None], torch.tensor([1.0]), torch.ones(1, 4), clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(terms.loss, torch.tensor([[-0.5, -1.0, -1.28, -1.28]]))


def test_dual_clip_bounds_negative_advantage_loss():
    log_ratio = RATIOS.log().repeat(2, 1)
    terms = clipped_surrogate(log_ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 4), 0.2, 0.2, dual_clip=2.0)
    torch.testing.assert_close(terms.loss[1], torch.tensor([0.8, 1.0, 1.5, 2.0]))
    torch.testing.assert_close(terms.loss[0], torch.tensor([-0.5, -1.0, -1.2, -1.2]))  # A > 0 untouched
    assert terms.dual_clipped.tolist() == [[False] * 4, [False, False, False, True]]
    with pytest.raises(ValueError, match="dual_clip"):
        clipped_surrogate(log_ratio, torch.tensor([1.0, -1.0]), torch.ones(2, 4), 0.2, 0.2, dual_clip=0.5)


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    log_ratio = RATIOS.log()[None].clone().requires_grad_(True)
    terms = clipped_surrogate(log_ratio, torch.tensor([1.0]), torch.ones(1, 4), 0.2, 0.2)
    terms.loss.sum().backward()
    # d(-A r)/d log r = -A r where unclipped, 0 where clipped
    torch.testing.assert_close(log_ratio.grad, torch.tensor([[-0.5, -1.0, 0.0, 0.0]]))


def test_masked_positions_contribute_nothing():
    log_ratio = RATIOS.log()[None]
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    terms = clipped_surrogate(log_ratio, torch.tensor([1.0]), mask, 0.2, 0.2)
    torch.testing.assert_close(terms.loss, torch.tensor([[-0.5, -1.0, 0.0, 0.0]]))
    assert not terms.clipped_high.any()


def test_sequence_level_importance_ratio_is_masked_mean():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.2, -2.4, 5.0]])  # last position is padding
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(importance_log_ratio(logprobs, old, mask, "sequence"), torch.full((1, 3), 0.3))
    torch.testing.assert_close(importance_log_ratio(logprobs, old, mask, "token"), logprobs - old)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize("mode,expected", [("token_mean", 10 / 4), ("sequence_mean", (6 / 3 + 4 / 1) / 2), ("constant", 10 / (2 * 4))])
def test_aggregation_modes(mode, expected):
    normalizer = LossNormalizer.of(MASK, max_response_length=4)
    assert aggregate_loss(PER_TOKEN, MASK, mode, normalizer).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_micro_batch_losses_sum_to_full_batch_loss(mode):
    normalizer = LossNormalizer.of(MASK, max_response_length=4)
    full = aggregate_loss(PER_TOKEN, MASK, mode, normalizer)
    parts = sum(aggregate_loss(PER_TOKEN[i : i + 1], MASK[i : i + 1], mode, normalizer) for i in range(2))
    torch.testing.assert_close(parts, full)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0
