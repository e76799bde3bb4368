"""The KL estimators verl 0.9.1 names (abs, clamped low_var_kl, the straight-through ``+`` variants) and the
entropy bonus aggregated as the loss (verl's ``agg_loss(entropy, loss_agg_mode)``), against hand-computed
values and gradients. verl's own functions are compared in integration_tests/verl/test_verl_loss_options.py."""

import math

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.corrections import PolicyWeights
from arctic_rl.modules.losses import LossConfig, LossNormalizer, Regularizers, entropy_bonus, grpo_family_loss, kl_penalty

REF = torch.tensor([[-1.5, -1.0]])  # log_r = logprobs - ref = [0.5, -1.0]
E = math.e


def kl_and_grad(estimator, logprobs=(-1.0, -2.0), ref=REF):
    logprobs = torch.tensor([list(logprobs)], dtype=torch.float64, requires_grad=True)
    kl = kl_penalty(logprobs, ref.double(), estimator)
    kl.sum().backward()
    return kl.detach(), logprobs.grad


@pytest.mark.parametrize("estimator,value,grad", [
    ("abs", [0.5, 1.0], [1.0, -1.0]),
    ("low_var_kl", [math.exp(-0.5) - 0.5, E - 2.0], [1.0 - math.exp(-0.5), 1.0 - E]),  # = k3 inside the clamps
    ("k3", [math.exp(-0.5) - 0.5, E - 2.0], [1.0 - math.exp(-0.5), 1.0 - E]),
    ("k1+", [0.5, -1.0], [0.5, -1.0]),  # "+": the named estimator's value, k2's gradient (log_r)
    ("k3+", [math.exp(-0.5) - 0.5, E - 2.0], [0.5, -1.0]),
    ("abs+", [0.5, 1.0], [0.5, -1.0]),
    ("low_var_kl+", [math.exp(-0.5) - 0.5, E - 2.0], [0.5, -1.0]),
])
def test_kl_estimators_values_and_gradients(estimator, value, grad):
    kl, g = kl_and_grad(estimator)
    torch.testing.assert_close(kl, torch.tensor([value], dtype=torch.float64))
    torch.testing.assert_close(g, torch.tensor([grad], dtype=torch.float64))


def test_low_var_kl_clamps_where_k3_does_not():
    # log_r = 30 and -30: ref - logprobs is clamped to -20 / 20, then the estimate to 10; k3 is unbounded
    kl, grad = kl_and_grad("low_var_kl", logprobs=(0.0, -30.0), ref=torch.tensor([[-30.0, 0.0]]))
    assert kl.tolist() == [[10.0, 10.0]] and grad.tolist() == [[0.0, 0.0]]
    k3, _ = kl_and_grad("k3", logprobs=(0.0, -30.0), ref=torch.tensor([[-30.0, 0.0]]))
    torch.testing.assert_close(k3, torch.tensor([[math.exp(-30) + 29.0, math.exp(30) - 31.0]], dtype=torch.float64))
    # inside the estimate's clamp but past 10 before it: log_r = -3 gives e^3 - 4 = 16.09 -> 10
    kl, _ = kl_and_grad("low_var_kl", logprobs=(-4.0, -1.0), ref=torch.tensor([[-1.0, -1.0]]))
    assert kl.tolist() == [[10.0, 0.0]]


def test_unknown_estimator_and_entropy_aggregation_are_refused():
    with pytest.raises(ValueError, match="kl_estimator must be one of 'k1', 'k2', 'k3', 'abs', 'low_var_kl'"):
        kl_penalty(REF, REF, "k2+")  # verl's k2+ is k2: the mapping sends k2
    with pytest.raises(ConfigError, match="kl_estimator"):
        Regularizers(kl_estimator="full")
    with pytest.raises(ConfigError, match="entropy_aggregation must be 'token_mean' or 'loss', got 'seq'"):
        Regularizers(entropy_aggregation="seq")


ENTROPY = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # 9s are padding
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
NORM = LossNormalizer(num_tokens=4.0, num_sequences=2.0, max_response_length=3)


@pytest.mark.parametrize("mode,aggregation,expected", [
    ("token_mean", "sequence_mean", 2.5),  # TRL: (1 + 2 + 3 + 4) / 4 whatever the loss's normaliser
    ("loss", "token_mean", 2.5),  # verl token-mean
    ("loss", "sequence_mean", 3.0),  # verl seq-mean-token-mean: (2 + 4) / 2
    ("loss", "sequence_sum", 5.0),  # (6 + 4) / 2
    ("loss", "constant", 10.0 / 6.0),  # 10 / (2 x 3)
])
def test_entropy_bonus_aggregations(mode, aggregation, expected):
    assert entropy_bonus(ENTROPY.double(), MASK.double(), mode, aggregation, NORM).item() == pytest.approx(expected, rel=1e-12)


def test_entropy_bonus_loss_mode_refuses_a_token_selection():
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        entropy_bonus(ENTROPY, MASK, "loss", "token_mean", NORM, selected=MASK)


def test_grpo_family_loss_adds_verl_kl_and_entropy_terms():
    """Zero advantages leave only the regularisers: loss = kl_coef x agg(low_var_kl) - entropy_coef x agg(entropy),
    both aggregated per sequence (verl seq-mean-token-mean), no importance-ratio factor on the KL."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, 0.0, 0.0]], dtype=torch.float64)
    entropy = ENTROPY.double().requires_grad_(True)
    reg = Regularizers(kl_coef=0.5, kl_estimator="low_var_kl", kl_bias_correction=False, entropy_coef=0.1,
                       entropy_aggregation="loss")
    loss, stats = grpo_family_loss(LossConfig(loss_type="grpo"), "sequence_mean", reg, logprobs, logprobs.detach(),
                                   torch.zeros(2, dtype=torch.float64), MASK.double(), NORM, ref, entropy, PolicyWeights())
    k3 = [math.exp(-0.5) - 0.5, E - 2.0, 0.0, math.exp(-1.0) - 1.0 + 1.0]  # log_r = 0.5, -1, 0; 1
    kl_agg = (sum(k3[:3]) / 3 + k3[3]) / 2
    assert loss.item() == pytest.approx(0.5 * kl_agg - 0.1 * 3.0, rel=1e-12)
    assert stats["kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)  # a token mean (metrics are float32)
    loss.backward()
    grad = [1 - math.exp(-0.5), 1 - E, 0.0]  # d k3 / d logprobs = 1 - exp(-log_r)
    expected = [[0.5 * g / 3 / 2 for g in grad], [0.5 * (1 - math.exp(-1.0)) / 2, 0.0, 0.0]]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(entropy.grad, -0.1 * torch.tensor([[1 / 6] * 3, [1 / 2, 0.0, 0.0]], dtype=torch.float64))
