"""Loss math against hand-computed values and TRL 1.16's formulas (``GRPOTrainer._compute_loss``)."""

import math

import pytest
import torch

from arctic_rl.loss_registry import get_loss
from arctic_rl.modules.losses import (
    LossConfig,
    LossNormalizer,
    aggregate_loss,
    importance_log_ratio,
    kl_penalty,
    masked_mean,
    policy_objective,
)


@pytest.mark.parametrize("estimator,expected", [("k1", [0.5, -1.0]), ("k2", [0.125, 0.5]), ("k3", [math.exp(-0.5) - 0.5, math.e - 2.0])])
def test_kl_estimators_match_hand_values(estimator, expected):
    logprobs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logprobs, ref, estimator), torch.tensor([expected]))
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logprobs, ref, "k4")


RATIOS = torch.tensor([0.5, 1.0, 1.5, 3.0])


def clipped(ratios, advantages, mask=None, **cfg):
    logprobs = ratios.log().clone().requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else mask
    terms = policy_objective(LossConfig(loss_type="dapo", **cfg), logprobs, torch.zeros_like(ratios), advantages, mask)
    return terms, logprobs


def test_clipped_surrogate_positive_and_negative_advantages():
    terms, _ = clipped(RATIOS.repeat(2, 1), torch.tensor([1.0, -1.0]))
    torch.testing.assert_close(terms.per_token, torch.tensor([[-0.5, -1.0, -1.2, -1.2], [0.8, 1.0, 1.5, 3.0]]))
    m = terms.metrics  # low: r < 0.8 with A < 0 (1 token); high: r > 1.2 with A > 0 (2 tokens); of 8
    assert (m["clip_ratio/low_mean"].item(), m["clip_ratio/high_mean"].item(), m["clip_ratio/region_mean"].item()) == (1 / 8, 2 / 8, 3 / 8)


def test_clip_higher_is_asymmetric():
    terms, _ = clipped(RATIOS[None], torch.tensor([1.0]), clip_high=0.28)
    torch.testing.assert_close(terms.per_token, torch.tensor([[-0.5, -1.0, -1.28, -1.28]]))


def test_dual_clip_caps_the_ratio_for_negative_advantages():
    terms, _ = clipped(RATIOS.repeat(2, 1), torch.tensor([1.0, -1.0]), dual_clip=2.0)
    torch.testing.assert_close(terms.per_token, torch.tensor([[-0.5, -1.0, -1.2, -1.2], [0.8, 1.0, 1.5, 2.0]]))
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)


def test_clipped_gradient_is_zero_where_clipped():
    terms, logprobs = clipped(RATIOS[None], torch.tensor([1.0]))
    terms.per_token.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, -1.0, 0.0, 0.0]]))  # -A r where unclipped


def test_masked_positions_are_not_counted_as_clipped():
    terms, _ = clipped(RATIOS[None], torch.tensor([1.0]), mask=torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert terms.metrics["clip_ratio/high_mean"].item() == 0.0


def test_cispo_clips_the_weight_but_keeps_the_gradient():
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(2.0), -1.0 - math.log(8.0)]])  # ratios 2 and 8
    terms = policy_objective(LossConfig(loss_type="cispo", cispo_max_ratio=5.0), logprobs, old, torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(terms.per_token, torch.tensor([[2.0, 5.0]]))  # -min(r, 5) A log pi
    terms.per_token.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, -5.0]]))  # weight detached: d/dlogp = -w A
    assert terms.metrics["cispo_clip_ratio"].item() == 0.5


def test_sapo_soft_gate_value_and_gradient_on_policy():
    logprobs = torch.tensor([[-0.7]], requires_grad=True)
    terms = policy_objective(LossConfig(loss_type="sapo"), logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 1))
    torch.testing.assert_close(terms.per_token, torch.tensor([[-2.0]]))  # -sigmoid(0) * 4 / 1 * 1
    terms.per_token.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0]]))  # -sigmoid'(0) * 4 * r
    neg = policy_objective(LossConfig(loss_type="sapo"), logprobs, logprobs.detach(), torch.tensor([-1.0]), torch.ones(1, 1))
    torch.testing.assert_close(neg.per_token, torch.tensor([[0.5 * 4 / 1.05]]))  # tau_neg = 1.05


def test_vespo_weight_is_one_on_policy_and_decays_off_policy():
    logprobs = torch.tensor([[-0.5, -0.25]])
    on = policy_objective(LossConfig(loss_type="vespo"), logprobs, logprobs, torch.tensor([1.0]), torch.ones(1, 2))
    torch.testing.assert_close(on.per_token, torch.tensor([[0.5, 0.25]]))  # phi(1) = 1: -A log pi
    # summed sequence log ratio 0.5 -> w = e^0.5; phi = exp(3 + 2 * 0.5 - 3 e^0.5) for A >= 0
    off = policy_objective(LossConfig(loss_type="vespo"), logprobs, logprobs - 0.25, torch.tensor([1.0]), torch.ones(1, 2))
    phi = math.exp(3 + 2 * 0.5 - 3 * math.exp(0.5))
    assert off.metrics["vespo/phi_seq_mean"].item() == pytest.approx(phi, rel=1e-5)


def test_sequence_level_ratio_is_one_value_per_sequence():
    logprobs, old = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.2, -2.4, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(importance_log_ratio(logprobs, old, mask, "sequence"), torch.tensor([[0.3]]))
    torch.testing.assert_close(importance_log_ratio(logprobs, old, mask, "token"), logprobs - old)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [("token_mean", 10 / 4), ("sequence_mean", (6 / 3 + 4 / 1) / 2), ("sequence_sum", (6 + 4) / 2), ("constant", 10 / (2 * 4))],
)
def test_aggregation_modes(mode, expected):
    normalizer = LossNormalizer.of(MASK, max_response_length=4)
    assert aggregate_loss(PER_TOKEN, MASK, mode, normalizer).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "sequence_sum", "constant"])
def test_micro_batch_losses_sum_to_full_batch_loss(mode):
    normalizer = LossNormalizer.of(MASK, max_response_length=4)
    full = aggregate_loss(PER_TOKEN, MASK, mode, normalizer)
    parts = sum(aggregate_loss(PER_TOKEN[i : i + 1], MASK[i : i + 1], mode, normalizer) for i in range(2))
    torch.testing.assert_close(parts, full)


def test_masked_mean_of_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


def test_unknown_loss_type_lists_the_choices():
    with pytest.raises(ValueError, match=r"loss_type must be one of \['bnpo', 'cispo', 'dapo'"):
        LossConfig(loss_type="ppo")


# ---------------------------------------------------------------- TRL parity
def trl_reference(loss_type, logp, old, adv, mask, level, ref=None, beta=0.0, bias_correction=True, eps=0.2, eps_high=0.28,
                  delta=None, max_completion_length=None, sg_logp=None):
    """TRL 1.16's per-batch loss (one micro-batch, one process), element by element in float64.
    ``sg_logp``: the log-probs seen by TRL's detached terms (cispo's weight, vespo's phi)."""
    n, t = len(logp), len(logp[0])
    sg = logp if sg_logp is None else sg_logp
    lengths = [sum(mask[i][j] for j in range(t)) for i in range(n)]
    coef1 = [[0.0] * t for _ in range(n)]
    for i in range(n):
        seq = sum((logp[i][j] - old[i][j]) * mask[i][j] for j in range(t)) / max(lengths[i], 1.0)
        for j in range(t):
            coef1[i][j] = math.exp(seq if level == "sequence" else logp[i][j] - old[i][j])
    loss_tok = [[0.0] * t for _ in range(n)]
    for i in range(n):
        a = adv[i]
        for j in range(t):
            c1 = coef1[i][j]
            if loss_type == "cispo":
                sg_ratio = math.exp(sg[i][j] - old[i][j]) if level == "token" else math.exp(
                    sum((sg[i][k] - old[i][k]) * mask[i][k] for k in range(t)) / max(lengths[i], 1.0))
                loss_tok[i][j] = -min(sg_ratio, eps_high) * a * logp[i][j]
            elif loss_type == "sapo":
                tau = 1.0 if a > 0 else 1.05
                loss_tok[i][j] = -(1 / (1 + math.exp(-tau * (c1 - 1)))) * 4 / tau * a
            elif loss_type == "vespo":
                log_w = min(max(sum(min(max(sg[i][k] - old[i][k], -20), 20) * mask[i][k] for k in range(t)), math.log(1e-8)), 20)
                k_, lam = (2.0, 3.0) if a >= 0 else (3.0, 2.0)
                loss_tok[i][j] = -math.exp(lam + k_ * log_w - lam * math.exp(log_w)) * a * logp[i][j]
            else:
                c2 = min(max(c1, 1 - eps), 1 + eps_high)
                c1c = c1 if delta is None else min(c1, delta)
                loss_tok[i][j] = -min(c1c * a, c2 * a)
            if beta:
                d = ref[i][j] - logp[i][j]
                kl = math.exp(d) - d - 1
                loss_tok[i][j] += beta * kl * (c1 if bias_correction else 1.0)
    total = sum(loss_tok[i][j] * mask[i][j] for i in range(n) for j in range(t))
    if loss_type in ("grpo", "sapo"):
        return sum(sum(loss_tok[i][j] * mask[i][j] for j in range(t)) / max(lengths[i], 1.0) for i in range(n)) / n
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return total / max(sum(lengths), 1.0)
    if loss_type == "dr_grpo":
        return total / (n * max_completion_length)
    if loss_type == "luspo":
        return total / n
    raise AssertionError(loss_type)


def fixed_batch(seed=0, n=4, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    ref = logp + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float64)
    return logp, old, ref, adv, mask


def our_loss(loss_type, logp, old, adv, mask, level, ref=None, beta=0.0, bias_correction=True, delta=None):
    cfg = LossConfig(loss_type=loss_type, importance_sampling_level=level, clip_low=0.2, clip_high=0.28, dual_clip=delta,
                     cispo_max_ratio=0.28)
    terms = policy_objective(cfg, logp, old, adv, mask)
    per_token = terms.per_token
    if beta:
        kl = kl_penalty(logp, ref, "k3") * (terms.ratio if bias_correction else 1.0)
        per_token = per_token + beta * kl
    return aggregate_loss(per_token, mask, get_loss(loss_type).aggregation, LossNormalizer.of(mask, 5))


def trl_value_and_grad(loss_type, logp, *args, **kwargs):
    """The oracle's loss and its gradient w.r.t. logp by central differences (float64)."""
    rows = lambda x: x.tolist()  # noqa: E731
    base = [rows(a) if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: rows(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    kw["sg_logp"] = rows(logp)  # detached terms do not move with the perturbation
    value = trl_reference(loss_type, rows(logp), *base, **kw)
    grad = torch.zeros_like(logp)
    h = 1e-6
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            up, down = logp.clone(), logp.clone()
            up[i, j] += h
            down[i, j] -= h
            grad[i, j] = (trl_reference(loss_type, rows(up), *base, **kw) - trl_reference(loss_type, rows(down), *base, **kw)) / (2 * h)
    return value, grad


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trl(loss_type, level):
    logp, old, ref, adv, mask = fixed_batch()
    x = logp.clone().requires_grad_(True)
    ours = our_loss(loss_type, x, old, adv, mask, level)
    ours.backward()
    value, grad = trl_value_and_grad(loss_type, logp, old.tolist(), adv.tolist(), mask.tolist(), level, max_completion_length=5)
    assert ours.item() == pytest.approx(value, abs=1e-10)
    torch.testing.assert_close(x.grad * mask, grad * mask, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_k3_kl_with_and_without_bias_correction_equals_trl(loss_type, bias_correction):
    logp, old, ref, adv, mask = fixed_batch(seed=1)
    x = logp.clone().requires_grad_(True)
    ours = our_loss(loss_type, x, old, adv, mask, "token", ref=ref, beta=0.04, bias_correction=bias_correction)
    ours.backward()
    value, grad = trl_value_and_grad(loss_type, logp, old, adv, mask, "token", ref=ref, beta=0.04,
                                     bias_correction=bias_correction, max_completion_length=5)
    assert ours.item() == pytest.approx(value, abs=1e-10)
    torch.testing.assert_close(x.grad * mask, grad * mask, atol=1e-6, rtol=1e-5)


def test_dual_clip_equals_trl_delta():
    logp, old, ref, adv, mask = fixed_batch(seed=2)
    old = logp - 1.5 * torch.rand_like(logp)  # large ratios so the cap binds
    x = logp.clone().requires_grad_(True)
    ours = our_loss("dapo", x, old, adv, mask, "token", delta=1.6)
    ours.backward()
    value, grad = trl_value_and_grad("dapo", logp, old, adv, mask, "token", delta=1.6)
    assert ours.item() == pytest.approx(value, abs=1e-10)
    torch.testing.assert_close(x.grad * mask, grad * mask, atol=1e-6, rtol=1e-5)
