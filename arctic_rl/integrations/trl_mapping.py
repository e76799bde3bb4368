"""TRL's GRPO vocabulary translated into arctic-rl's: the loss settings of a ``GRPOConfig``, the
normaliser each ``loss_type`` divides by, and TRL's padded prompt+completion rows as ZoRRo's inputs.

Pure functions over plain values and tensors (no ``trl`` import), so they are tested on their own
(``tests/integrations/test_trl_mapping.py``) and ``trl.py`` stays a thin subclass.

TRL's normalisers (``GRPOTrainer._compute_loss``, TRL 1.16), per micro-batch of ``B`` sequences under
``A`` gradient-accumulation steps, with arctic-rl's ``LossNormalizer`` fields that reproduce them:

| loss_type | TRL divides the masked sum by | arctic-rl aggregation, normaliser |
| --- | --- | --- |
| grpo, sapo | ``A`` x each sequence's token count, then mean over ``B`` | sequence_mean, ``num_sequences = B A`` |
| luspo | ``A B`` (token sums per sequence) | sequence_sum, ``num_sequences = B A`` |
| bnpo | ``A`` x the micro-batch's tokens | token_mean, ``num_tokens = tokens A`` |
| dr_grpo | ``A B`` x ``max_completion_length`` | constant, ``num_sequences = B A`` |
| dapo, cispo, vespo | the generation batch's tokens / processes x ``A`` / ``steps_per_generation`` | token_mean, that count |
| a plugin loss | its registered aggregation (none: its own way) | its own, over dapo's ``num_tokens``, ``num_sequences = B A`` |

In evaluation ``A`` is 1 and dapo's count is not rescaled, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from arctic_rl.modules.builtin_losses import fit_loss_config
from arctic_rl.loss_registry import PLUGIN_HINT, get_loss, is_loss, loss_names
from arctic_rl.modules.losses import LossNormalizer
from arctic_rl.options import LossConfig, Regularizers


@dataclass(frozen=True)
class TrlLossSettings:
    """Everything of a ``GRPOConfig`` (as resolved by ``GRPOTrainer.__init__``) that arctic-rl's
    ``grpo_family_loss`` needs; built by :func:`loss_settings`."""

    config: LossConfig
    regularizers: Regularizers
    max_completion_length: int

    @property
    def aggregation(self) -> str | None:
        """The registered loss's normaliser (None: a loss normalising its own way)."""
        return get_loss(self.config.loss_type).aggregation

    @property
    def options(self) -> dict:
        """The loss config the registered loss gets (``builtin_losses.fit_loss_config``)."""
        return fit_loss_config(self.config, self.regularizers)


def loss_settings(
    loss_type: str,
    importance_sampling_level: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    beta: float,
    use_bias_correction_kl: bool,
    max_completion_length: int,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    vespo_params: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0),
) -> TrlLossSettings:
    """arctic-rl's loss settings with TRL's meanings: ``epsilon_low`` / ``epsilon_high`` are the PPO clip
    range (``epsilon_high`` is the ratio cap under ``cispo``, as in TRL), ``delta`` the dual-clip cap,
    ``beta`` the k3 KL coefficient. ``sapo_temperatures`` is (pos, neg); ``vespo_params`` is
    (k_pos, lambda_pos, k_neg, lambda_neg). Unknown loss types raise naming ``loss_type``."""
    if not is_loss(loss_type):  # TRL's names are the built-ins'; a registered (plugin) loss works too
        raise ValueError(f"GRPOConfig.loss_type={loss_type!r}: arctic-rl's losses are {loss_names()}{PLUGIN_HINT}")
    k_pos, lambda_pos, k_neg, lambda_neg = vespo_params
    config = LossConfig(
        loss_type=loss_type,
        importance_sampling_level=importance_sampling_level,
        clip_low=epsilon_low,
        clip_high=epsilon_high,
        dual_clip=delta,
        cispo_max_ratio=epsilon_high,
        sapo_temperature_pos=sapo_temperatures[0],
        sapo_temperature_neg=sapo_temperatures[1],
        vespo_k_pos=k_pos,
        vespo_lambda_pos=lambda_pos,
        vespo_k_neg=k_neg,
        vespo_lambda_neg=lambda_neg,
    )
    regularizers = Regularizers(kl_coef=beta, kl_estimator="k3", kl_bias_correction=use_bias_correction_kl)
    return TrlLossSettings(config=config, regularizers=regularizers, max_completion_length=max_completion_length)


def trl_normalizer(
    settings: TrlLossSettings,
    mask: torch.Tensor,
    num_items_in_batch: float,
    accumulation_steps: int,
    steps_per_generation: int,
    num_processes: int,
    training: bool,
) -> LossNormalizer:
    """The ``LossNormalizer`` under which arctic-rl's aggregation of one micro-batch (``mask [B, T]``)
    equals TRL's loss for it (module docstring's table). ``num_items_in_batch``: TRL's count of the
    generation batch's completion tokens over all processes."""
    accumulation = accumulation_steps if training else 1
    sequences = float(mask.shape[0] * accumulation)
    if settings.config.loss_type == "bnpo":
        tokens = mask.sum().item() * accumulation
    else:  # dapo, cispo, vespo read it; for the others it only feeds the unused field
        tokens = max(float(num_items_in_batch), 1.0) / num_processes
        if training:
            tokens = tokens * accumulation_steps / steps_per_generation
    return LossNormalizer(num_tokens=tokens, num_sequences=sequences, max_response_length=settings.max_completion_length)


def split_prompt_completion(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """TRL's rows ``[left-padded prompt | right-padded completion]`` (``input_ids``, ``attention_mask``
    ``[N, P + C]``, ``C = logits_to_keep``) as ZoRRo's inputs: each prompt's real tokens (no padding),
    ``completion_ids [N, C]`` and ``completion_mask [N, C]``. A row whose prompt has no real token
    raises naming the row (ZoRRo needs a token to predict the completion's first one from)."""
    if not 0 < logits_to_keep < input_ids.shape[1]:
        raise ValueError(f"logits_to_keep={logits_to_keep} must leave prompt tokens in rows of length {input_ids.shape[1]}")
    prompt_ids = input_ids[:, :-logits_to_keep].cpu()
    prompt_mask = attention_mask[:, :-logits_to_keep].cpu().bool()
    prompts = [row[keep].tolist() for row, keep in zip(prompt_ids, prompt_mask)]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"row {i}: the prompt has no unmasked token (prompt_mask is all zeros)")
    return prompts, input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:]
