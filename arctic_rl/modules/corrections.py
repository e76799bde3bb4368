"""Loss-side corrections with TRL 1.16's names and meanings, as pure functions over tensors: the
rollout/trainer mismatch correction (``vllm_importance_sampling_*``), off-policy sequence masking
(``off_policy_mask_threshold``) and masking of truncated completions (``mask_truncated_completions``).

Shapes as in ``losses.py``: ``N`` sequences, ``T`` response positions, ``mask [N, T]`` 1.0 on the
tokens that count. Every factor here is computed per sequence (never across rows), so it does not
depend on how a batch is split into micro-batches or ranks. ``tests/modules/test_corrections.py``
checks each against TRL's formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from arctic_rl.options.corrections import SAMPLER_CORRECTION_MODES, CorrectionConfig, SamplerCorrectionMode
from arctic_rl.rollout.batch import RolloutBatch

@dataclass
class PolicyWeights:
    """Factors on the per-token policy loss, applied in TRL's order before the KL term is added:
    ``off_policy`` x ``entropy`` x ``importance`` (``importance`` enters VESPO's Gamma weight instead).
    None: no factor."""

    importance: torch.Tensor | None = None  # [N, T] or [N, 1]: pi_old / pi_sampler, truncated or masked
    off_policy: torch.Tensor | None = None  # [N, 1]: 0 drops a sequence (off_policy_mask_threshold)
    entropy: torch.Tensor | None = None  # [N, T]: 1 on the high-entropy tokens (top_entropy_quantile)

    @property
    def empty(self) -> bool:
        return self.importance is None and self.off_policy is None and self.entropy is None


def sampler_importance_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, mode: SamplerCorrectionMode,
    clip_min: float | None, clip_max: float | None,
) -> torch.Tensor:
    """TRL's ``vllm_importance_sampling_ratio``: ``rho = pi_old / pi_sampler``, the trainer's log-probs at
    sampling time over the engine's, per token ``[N, T]`` (``token_*``) or per sequence ``[N, 1]``
    (``sequence_*``: the product over the sequence's tokens, i.e. the summed log difference).
    ``*_truncate`` clamps ``rho`` to ``[clip_min, clip_max]``; ``*_mask`` sets it to 0 outside. Masked
    positions have log difference 0 (rho 1 before bounds); so do NaN sampler log-probs. Never has grad."""
    diff = torch.nan_to_num((old_logprobs.detach() - sampler_logprobs) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        return ratio if clip_min is None and clip_max is None else torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode.endswith("_mask"):
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    raise ValueError(f"vllm_importance_sampling_mode must be one of {', '.join(SAMPLER_CORRECTION_MODES)}, got {mode!r}")


@torch.no_grad()
def sampler_correction_metrics(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> dict[str, float]:
    """TRL's metrics of the correction over one rollout batch: ``sampling/sampling_logp_difference/{mean,max}``
    (``|log pi_old - log pi_sampler|`` over the masked, non-NaN tokens) and
    ``sampling/importance_sampling_ratio/{min,mean,max}`` (over masked tokens, or over sequences for ``[N, 1]``)."""
    keep = mask.bool()
    delta = (old_logprobs - sampler_logprobs).abs()
    delta = delta[keep & ~torch.isnan(delta)]
    flat = weights.flatten() if weights.shape[-1] == 1 else weights[keep]

    def stat(values: torch.Tensor, fn) -> float:
        return float(fn(values)) if values.numel() else 0.0

    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(flat, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(flat, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(flat, torch.max),
    }


def off_policy_sequence_mask(
    advantages: torch.Tensor, logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9; TRL's ``get_off_policy_mask``):
    keep a sequence unless its advantage is negative *and* its mean ``log pi_sampler - log pi`` over its
    tokens (a KL estimate of the behaviour policy to the current one; NaN sampler log-probs count 0)
    exceeds ``threshold``. ``advantages [N]`` or ``[N, 1]``; returns ``[N, 1]`` of 0.0 / 1.0 in ``mask``'s dtype."""
    kl = torch.nan_to_num(sampler_logprobs - logprobs.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    advantages = advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages[:, :1]
    return ((advantages >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def completion_loss_mask(response_mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """``mask_truncated_completions`` (DAPO's overlong filtering, TRL's meaning): the response mask with the
    rows of completions cut by the length limit zeroed, so they add no loss and no token to the
    normalisers. ``truncated [N]`` bool (``RolloutBatch.truncated``)."""
    if truncated is None:
        raise ValueError("mask_truncated_completions needs RolloutBatch.truncated (finish_reason == 'length' per completion)")
    return response_mask * (~truncated.bool()).to(response_mask.dtype).unsqueeze(-1)


def loss_mask_of(cfg: CorrectionConfig, batch: RolloutBatch) -> torch.Tensor:
    """The tokens ``batch``'s loss and normalisers count: its response mask, less truncated completions
    under ``mask_truncated_completions``."""
    if cfg.mask_truncated_completions:
        return completion_loss_mask(batch.response_mask, batch.truncated)
    return batch.response_mask


def correction_fits_loss(loss_type: str, correction: bool, mode: str) -> bool:
    """Whether loss ``loss_type`` takes the mismatch correction (``correction``: on) in ``mode``: VESPO enters
    the importance weight per token in its Gamma weight, so with the correction on it needs a ``token_*`` mode (TRL)."""
    return not (loss_type == "vespo" and correction and not mode.startswith("token_"))


def policy_weights(
    cfg: CorrectionConfig, advantages: torch.Tensor, logprobs: torch.Tensor, old_logprobs: torch.Tensor | None,
    sampler_logprobs: torch.Tensor, mask: torch.Tensor, entropy_mask: torch.Tensor | None = None,
) -> PolicyWeights | None:
    """The factors on a micro-batch's per-token policy loss: the mismatch correction (from ``old_logprobs``
    ``[N, T]``), the off-policy sequence mask (from the current ``logprobs``) and ``entropy_mask``, as ``cfg``
    turns them on; None when none is. ``advantages [N]``, ``sampler_logprobs`` and ``mask`` ``[N, T]``."""
    weights = PolicyWeights(entropy=entropy_mask)
    if cfg.vllm_importance_sampling_correction:
        weights.importance = sampler_importance_weights(
            old_logprobs, sampler_logprobs, mask, cfg.vllm_importance_sampling_mode,
            cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    if cfg.off_policy_mask_threshold is not None:
        weights.off_policy = off_policy_sequence_mask(advantages, logprobs, sampler_logprobs, mask, cfg.off_policy_mask_threshold)
    return None if weights.empty else weights


def policy_weights_of(cfg: CorrectionConfig, batch: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor) -> PolicyWeights | None:
    """``GRPOModule.policy_weights``' default: :func:`policy_weights` of ``batch`` (the correction needs
    ``batch.old_logprobs``), with ``batch.entropy_mask``."""
    return policy_weights(cfg, batch.advantages, logprobs, batch.old_logprobs, batch.sampler_logprobs, mask, batch.entropy_mask)


def rollout_correction_metrics(cfg: CorrectionConfig, batch: RolloutBatch) -> dict[str, float]:
    """The correction's metrics over a whole rollout batch (``sampler_correction_metrics``); {} when it is off."""
    if not cfg.vllm_importance_sampling_correction:
        return {}
    mask = loss_mask_of(cfg, batch)
    weights = sampler_importance_weights(batch.old_logprobs, batch.sampler_logprobs, mask, cfg.vllm_importance_sampling_mode,
                                         cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max)
    return sampler_correction_metrics(batch.old_logprobs, batch.sampler_logprobs, mask, weights)
