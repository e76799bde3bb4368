"""TRL's GRPO vocabulary in arctic-rl's terms (``arctic_rl/integrations/trl_mapping.py``): every loss type's
normaliser reproduces TRL 1.16's ``_compute_loss`` aggregation (restated below from its source), and TRL's
padded rows split into ZoRRo's inputs."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.integrations.trl_mapping import loss_settings, split_prompt_completion, trl_normalizer
from arctic_rl.modules.losses import GRPO_FAMILY, aggregate_loss

B, T, ACCUM, STEPS_PER_GEN, PROCS, MAX_LEN = 3, 5, 2, 4, 2, 7


def trl_aggregate(loss_type: str, per_token, mask, num_items_in_batch: float, training: bool):
    """TRL 1.16 ``GRPOTrainer._compute_loss``'s reduction of ``per_token_loss`` (its if/elif, in words
    and code): the reference the mapping must reproduce."""
    accum = ACCUM if training else 1
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accum
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accum
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * MAX_LEN) / accum
    if loss_type == "luspo":
        return (per_token * mask).sum(-1).mean() / accum
    normalizer = max(num_items_in_batch, 1.0) / PROCS  # dapo, cispo, vespo
    if training:
        normalizer = normalizer * ACCUM / STEPS_PER_GEN
    return (per_token * mask).sum() / normalizer


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("loss_type", sorted(GRPO_FAMILY))
def test_each_loss_types_normaliser_reproduces_trls_aggregation(loss_type, training):
    generator = torch.Generator().manual_seed(1)
    per_token = torch.randn(B, T, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float64)
    level = "sequence" if loss_type == "luspo" else "token"  # the pairing LUSPO is defined with
    settings = loss_settings(loss_type, level, 0.2, 0.28, None, 0.0, True, MAX_LEN)
    normalizer = trl_normalizer(settings, mask, 40.0, ACCUM, STEPS_PER_GEN, PROCS, training)
    ours = aggregate_loss(per_token, mask, settings.aggregation, normalizer)
    assert ours.item() == pytest.approx(trl_aggregate(loss_type, per_token, mask, 40.0, training).item(), rel=1e-12)


def test_loss_settings_carry_trls_meanings():
    settings = loss_settings("cispo", "sequence", 0.2, 5.0, 3.0, 0.04, False, 64, (0.9, 1.1), (1.0, 2.0, 3.0, 4.0))
    cfg, reg = settings.config, settings.regularizers
    assert (cfg.clip_low, cfg.clip_high, cfg.cispo_max_ratio, cfg.dual_clip) == (0.2, 5.0, 5.0, 3.0)
    assert cfg.importance_sampling_level == "sequence"
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (0.9, 1.1)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (1.0, 2.0, 3.0, 4.0)
    assert (reg.kl_coef, reg.kl_estimator, reg.kl_bias_correction, reg.entropy_coef) == (0.04, "k3", False, 0.0)
    assert settings.aggregation == "token_mean" and settings.max_completion_length == 64


def test_unknown_loss_type_names_the_field():
    with pytest.raises(ValueError, match=r"GRPOConfig.loss_type='ppo'"):
        loss_settings("ppo", "token", 0.2, 0.2, None, 0.0, True, 8)


def test_split_strips_left_padding_and_keeps_completions():
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8, 0], [4, 5, 6, 7, 9, 9, 9]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    prompts, completion_ids, completion_mask = split_prompt_completion(input_ids, attention_mask, 3)
    assert prompts == [[5, 6], [4, 5, 6, 7]]
    assert completion_ids.tolist() == [[7, 8, 0], [9, 9, 9]]
    assert completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_split_refuses_an_empty_prompt_naming_the_row():
    input_ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    attention_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="row 1: the prompt has no unmasked token"):
        split_prompt_completion(input_ids, attention_mask, 2)
    with pytest.raises(ValueError, match="logits_to_keep=3"):
        split_prompt_completion(input_ids, attention_mask, 3)
