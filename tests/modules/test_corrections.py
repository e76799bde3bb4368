"""The loss-side options (off-policy corrections) against hand values from TRL 1.16's definitions (``GRPOTrainer``:
``_generate_and_score_completions`` for the mismatch correction, ``get_off_policy_mask``,
``get_high_entropy_mask``, ``_compute_loss`` for the order the factors apply in and ``clip_ratio/*``)."""

import math

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.corrections import (
    CorrectionConfig,
    PolicyWeights,
    completion_loss_mask,
    off_policy_sequence_mask,
    sampler_correction_metrics,
    sampler_importance_weights,
)
from arctic_rl.modules.losses import LossConfig, LossNormalizer, Regularizers, grpo_family_loss, policy_objective
from arctic_rl.modules.step_metrics import accumulate
from arctic_rl.modules.token_selection import entropy_threshold, high_entropy_mask, linear_quantile

D = torch.float64
# two sequences; row 0 has 2 real tokens (third is padding), row 1 has 3
OLD = torch.tensor([[-1.0, -2.0, -0.7], [-0.3, -0.4, -0.5]], dtype=D)
SAMPLER = torch.tensor([[-1.5, -1.0, -9.0], [-0.3, -0.2, -0.6]], dtype=D)
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=D)
# log(pi_old / pi_sampler) per token: row 0 [0.5, -1.0, (pad) 0]; row 1 [0, -0.2, 0.1]; sums -0.5 and -0.1
E = math.exp


@pytest.mark.parametrize("mode,lo,hi,expected", [
    ("token_truncate", 0.5, 1.5, [[1.5, 0.5, 1.0], [1.0, E(-0.2), E(0.1)]]),
    ("token_truncate", None, 3.0, [[E(0.5), E(-1.0), 1.0], [1.0, E(-0.2), E(0.1)]]),  # TRL's defaults
    ("token_mask", 0.5, 1.5, [[0.0, 0.0, 1.0], [1.0, E(-0.2), E(0.1)]]),
    ("token_mask", None, 1.05, [[0.0, E(-1.0), 1.0], [1.0, E(-0.2), 0.0]]),  # no lower bound: -inf
    ("sequence_truncate", 0.7, 3.0, [[0.7], [E(-0.1)]]),
    ("sequence_mask", 0.7, 3.0, [[0.0], [E(-0.1)]]),
    ("sequence_mask", None, None, [[E(-0.5)], [E(-0.1)]]),  # no bounds: the plain product of token ratios
])
def test_sampler_importance_weights_match_trl_modes(mode, lo, hi, expected):
    weights = sampler_importance_weights(OLD, SAMPLER, MASK, mode, lo, hi)
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=D), rtol=0, atol=1e-15)


def test_a_nan_sampler_logprob_gets_ratio_one_and_is_left_out_of_the_difference():
    sampler = SAMPLER.clone()
    sampler[1, 1] = float("nan")
    weights = sampler_importance_weights(OLD, sampler, MASK, "token_truncate", None, 3.0)
    assert weights[1, 1].item() == 1.0
    metrics = sampler_correction_metrics(OLD, sampler, MASK, weights)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.1) / 4, abs=1e-12)


def test_correction_metrics_have_trl_names_and_values():
    token = sampler_importance_weights(OLD, SAMPLER, MASK, "token_truncate", 0.5, 1.5)
    m = sampler_correction_metrics(OLD, SAMPLER, MASK, token)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 1.0 + 0.0 + 0.2 + 0.1) / 5, abs=1e-12)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(1.0, abs=1e-12)
    real = [1.5, 0.5, 1.0, E(-0.2), E(0.1)]  # masked tokens only
    assert (m["sampling/importance_sampling_ratio/min"], m["sampling/importance_sampling_ratio/max"]) == (0.5, 1.5)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(real) / 5, abs=1e-12)
    seq = sampler_importance_weights(OLD, SAMPLER, MASK, "sequence_mask", 0.7, 3.0)  # one value per sequence
    assert sampler_correction_metrics(OLD, SAMPLER, MASK, seq)["sampling/importance_sampling_ratio/mean"] == pytest.approx(E(-0.1) / 2)


def test_off_policy_mask_drops_negative_advantage_sequences_far_from_the_sampler():
    logprobs = torch.tensor([[-1.0, -1.0, 0.0]] * 4, dtype=D)
    sampler = torch.tensor([[-0.2, -0.6, 5.0], [-0.2, -0.6, 5.0], [-1.0, -1.2, 5.0], [-1.0, -1.2, 5.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4, dtype=D)  # the padded 5.0 never counts
    advantages = torch.tensor([-1.0, 1.0, -1.0, 0.0], dtype=D)
    # mean(log pi_sampler - log pi): rows 0, 1: (0.8 + 0.4) / 2 = 0.6; rows 2, 3: (0 - 0.2) / 2 = -0.1
    keep = off_policy_sequence_mask(advantages, logprobs, sampler, mask, threshold=0.5)
    torch.testing.assert_close(keep, torch.tensor([[0.0], [1.0], [1.0], [1.0]], dtype=D))
    assert off_policy_sequence_mask(advantages, logprobs, sampler, mask, threshold=0.61)[0].item() == 1.0  # KL <= delta keeps


def test_truncated_completions_leave_the_loss_mask():
    mask = completion_loss_mask(MASK, torch.tensor([True, False]))
    torch.testing.assert_close(mask, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=D))
    with pytest.raises(ValueError, match="RolloutBatch.truncated"):
        completion_loss_mask(MASK, None)


ENTROPY = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 4.0, 4.0]], dtype=D)
ENT_MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]], dtype=D)  # 4.0s are padding


@pytest.mark.parametrize("rho,threshold,selected", [
    # torch.quantile(values, 1 - rho), linear: the six real values sorted 0.1 0.2 0.3 0.5 0.7 0.9
    (0.5, 0.4, [[0, 1, 1, 0], [1, 0, 0, 0]]),  # position 2.5: between 0.3 and 0.5
    (0.2, 0.7, [[0, 0, 1, 0], [1, 0, 0, 0]]),  # position 4.0: 0.7 itself (>= keeps it)
    (0.0, 0.9, [[0, 0, 1, 0], [0, 0, 0, 0]]),  # only the highest-entropy token
    (1.0, 0.1, [[1, 1, 1, 1], [1, 1, 0, 0]]),  # every real token
])
def test_top_entropy_quantile_keeps_the_high_entropy_tokens(rho, threshold, selected):
    found = entropy_threshold(ENTROPY, ENT_MASK, rho)
    assert found == pytest.approx(threshold, abs=1e-12)
    torch.testing.assert_close(high_entropy_mask(ENTROPY, ENT_MASK, found), torch.tensor(selected, dtype=D))


def test_linear_quantile_equals_torch_quantile_and_an_empty_mask_selects_nothing():
    values = torch.rand(1001, generator=torch.Generator().manual_seed(0), dtype=D)
    for q in (0.0, 0.13, 0.5, 0.8, 1.0):
        assert linear_quantile(values, q).item() == pytest.approx(torch.quantile(values, q).item(), abs=1e-15)
    assert entropy_threshold(ENTROPY, torch.zeros_like(ENT_MASK), 0.2) is None
    assert high_entropy_mask(ENTROPY, ENT_MASK, None).sum().item() == 0


def test_factors_apply_in_trls_order_before_the_kl_term():
    """per-token = policy x off_policy x entropy x importance + beta x KL (KL never masked); the entropy
    bonus is the mean over the entropy-selected tokens (TRL's effective mask)."""
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(2, 3, generator=g, dtype=D)
    ref = -torch.rand(2, 3, generator=g, dtype=D)
    entropy = torch.rand(2, 3, generator=g, dtype=D)
    adv = torch.tensor([0.7, -1.3], dtype=D)
    weights = PolicyWeights(importance=torch.tensor([[1.2], [0.4]], dtype=D), off_policy=torch.tensor([[1.0], [0.0]], dtype=D),
                            entropy=torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=D))
    norm = LossNormalizer(num_tokens=5.0, num_sequences=2.0, max_response_length=3, num_selected_tokens=3.0)
    cfg, reg = LossConfig(loss_type="dapo"), Regularizers(kl_coef=0.1, entropy_coef=0.01)
    loss, _ = grpo_family_loss(cfg, "token_mean", reg, logprobs, OLD, adv, MASK, norm, ref, entropy, weights)
    ratio = torch.exp(logprobs - OLD)
    surrogate = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    kl = (torch.exp(ref - logprobs) - (ref - logprobs) - 1) * ratio
    per_token = surrogate * weights.off_policy * weights.entropy * weights.importance + 0.1 * kl
    expected = (per_token * MASK).sum() / 5.0 - 0.01 * (entropy * MASK * weights.entropy).sum() / 3.0
    assert loss.item() == pytest.approx(expected.item(), abs=1e-14)


def test_vespo_folds_the_token_correction_into_its_sequence_weight():
    """TRL's get_gamma_weights: log w = sum(clamp(log r)) + sum(clamp(log rho, log 1e-8, 20)); a masked
    (zero) rho enters as log 1e-8."""
    logprobs = torch.tensor([[-1.0, -0.5, 0.0]], dtype=D)
    old = torch.tensor([[-1.1, -0.3, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    rho = torch.tensor([[1.5, 0.0, 1.0]], dtype=D)
    phi = policy_objective(LossConfig(loss_type="vespo"), logprobs, old, torch.tensor([1.0], dtype=D), mask, rho).metrics["vespo/phi_seq_mean"]
    log_w = (0.1 - 0.2) + (math.log(1.5) + math.log(1e-8))  # k = 2, lambda = 3 for A >= 0
    assert phi.item() == pytest.approx(math.exp(3.0 + 2.0 * log_w - 3.0 * math.exp(log_w)), rel=1e-12)


def test_clip_ratio_low_min_and_high_max_are_over_sequences():
    """TRL: min over sequences of each sequence's low-clipped fraction, max of the high-clipped one."""
    ratios = torch.tensor([[0.5, 1.0, 1.0, 1.0], [0.5, 0.5, 1.0, 9.0], [1.5, 1.5, 1.0, 1.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=D)
    adv = torch.tensor([-1.0, -1.0, 1.0], dtype=D)
    m = policy_objective(LossConfig(loss_type="dapo"), ratios.log(), torch.zeros_like(ratios), adv, mask).metrics
    assert m["clip_ratio/low_min"].item() == pytest.approx(0.0)  # row 2 has no low-clipped token
    assert m["clip_ratio/high_max"].item() == pytest.approx(0.5)  # row 2: 2 of 4
    m = policy_objective(LossConfig(loss_type="dapo"), ratios[:2].log(), torch.zeros(2, 4, dtype=D), adv[:2], mask[:2]).metrics
    assert m["clip_ratio/low_min"].item() == pytest.approx(0.25)  # rows 0 (1/4) and 1 (2/3; the 9.0 is padding)


def test_step_stats_keep_the_extremes_over_micro_batches():
    sums: dict[str, float] = {}
    accumulate(sums, {"loss": 1.0, "clip_ratio/low_min": 0.3, "clip_ratio/high_max": float("nan")}, 0.5)
    accumulate(sums, {"loss": 3.0, "clip_ratio/low_min": 0.1, "clip_ratio/high_max": 0.2}, 0.5)
    assert sums == {"loss": 2.0, "clip_ratio/low_min": 0.1, "clip_ratio/high_max": 0.2}


@pytest.mark.parametrize("field,value,match", [
    ("vllm_importance_sampling_mode", "token", "must be one of token_truncate"),
    ("vllm_importance_sampling_clip_min", 4.0, "clip_min <= clip_max"),
    ("top_entropy_quantile", 1.5, r"top_entropy_quantile must be in \[0, 1\]"),
    ("off_policy_mask_threshold", 0.0, "off_policy_mask_threshold must be > 0"),
])
def test_bad_option_values_are_named(field, value, match):
    with pytest.raises(ConfigError, match=f"model.{field}" if field != "vllm_importance_sampling_clip_min" else match):
        CorrectionConfig(**{field: value})
    with pytest.raises(ConfigError, match=match):
        CorrectionConfig(**{field: value})


@pytest.mark.parametrize("loss_type,correction,mode,fits", [
    ("vespo", True, "token_truncate", True),
    ("vespo", True, "token_mask", True),
    ("vespo", True, "sequence_mask", False),  # VESPO weights per token (TRL refuses it too)
    ("vespo", True, "sequence_truncate", False),
    ("vespo", False, "sequence_mask", True),  # correction off: the mode is unused
    ("dapo", True, "sequence_mask", True),
])
def test_correction_fits_loss(loss_type, correction, mode, fits):
    from arctic_rl.modules.corrections import correction_fits_loss

    assert correction_fits_loss(loss_type, correction, mode) is fits


def test_policy_weights_of_a_batch_are_those_of_its_tensors():
    from arctic_rl.modules.corrections import policy_weights, policy_weights_of
    from arctic_rl.rollout.batch import RolloutBatch

    cfg = CorrectionConfig(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                           off_policy_mask_threshold=0.1)
    advantages, logprobs = torch.tensor([-1.0, 1.0], dtype=D), torch.tensor([[-2.0, -2.0, 0.0], [-0.3, -0.4, -0.5]], dtype=D)
    batch = RolloutBatch(prompt_token_ids=[[1], [1]], response_ids=torch.zeros(2, 3, dtype=torch.long), response_mask=MASK,
                         sampler_logprobs=SAMPLER, rewards=advantages, advantages=advantages, group_size=2, old_logprobs=OLD)
    of_batch = policy_weights_of(cfg, batch, logprobs, MASK)
    of_tensors = policy_weights(cfg, advantages, logprobs, OLD, SAMPLER, MASK)
    assert torch.equal(of_batch.importance, sampler_importance_weights(OLD, SAMPLER, MASK, "token_truncate", None, 3.0))
    assert torch.equal(of_batch.importance, of_tensors.importance)
    # row 0: advantage < 0 and mean(sampler - logprobs) = (0.5 + 1.0) / 2 = 0.75 > 0.1: dropped
    assert of_batch.off_policy.tolist() == of_tensors.off_policy.tolist() == [[0.0], [1.0]]
    assert of_batch.entropy is None and of_tensors.entropy is None
    assert policy_weights(CorrectionConfig(), advantages, logprobs, None, SAMPLER, MASK) is None
