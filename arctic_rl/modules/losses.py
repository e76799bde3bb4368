"""GRPO policy-loss math as pure functions over tensors.

Shapes: ``N`` sequences (prompts x G), ``T`` response positions (right-padded). Every function
takes a ``mask`` of shape ``[N, T]`` (1.0 on real response tokens) and never looks at padded
positions. Nothing here knows about Lightning, models or engines; ``tests/modules/test_losses.py``
checks each function against hand-computed values.

Normalisers are passed in, not computed from the micro-batch: a token-mean loss over a rollout
batch split into micro-batches (or ranks) divides each micro-batch's token sum by the token count of
the *whole* rollout batch, so summing the micro-batch losses gives exactly the full-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
LossAggregation = Literal["token_mean", "sequence_mean", "constant"]
ImportanceSamplingLevel = Literal["token", "sequence"]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With ``log_r = logprobs - ref_logprobs``:
    k1 = log_r (unbiased, high variance, can be negative); k2 = log_r**2 / 2;
    k3 = exp(-log_r) - 1 + log_r (unbiased, always >= 0; the GRPO paper's choice).

    Args:
        logprobs: ``[N, T]`` log pi(token) under the policy being trained.
        ref_logprobs: ``[N, T]`` log pi_ref(token) under the frozen reference model.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    raise ValueError(f"kl_estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def importance_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    level: ImportanceSamplingLevel,
) -> torch.Tensor:
    """``log(pi / pi_old)`` per token (``level="token"``), or the sequence's length-normalised
    log ratio broadcast over its tokens (``level="sequence"``, GSPO, Zheng et al. 2025). ``[N, T]``."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level == "sequence":
        lengths = mask.sum(-1).clamp(min=1.0)
        seq = (log_ratio * mask).sum(-1) / lengths
        return seq.unsqueeze(-1).expand_as(log_ratio)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


@dataclass
class PolicyLossTerms:
    """Per-token pieces of the clipped surrogate; all ``[N, T]``, zero where ``mask`` is 0."""

    loss: torch.Tensor  # surrogate loss to minimise (before aggregation)
    ratio: torch.Tensor  # pi / pi_old
    clipped_low: torch.Tensor  # bool: ratio < 1 - eps_low and advantage < 0
    clipped_high: torch.Tensor  # bool: ratio > 1 + eps_high and advantage > 0
    dual_clipped: torch.Tensor  # bool: the dual-clip bound was active


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> PolicyLossTerms:
    """PPO's clipped surrogate ``max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))``.

    Asymmetric ``clip_low``/``clip_high`` give DAPO's "clip-higher". ``dual_clip = c > 1`` bounds the
    loss of negative-advantage tokens by ``-A * c`` (Ye et al. 2020, "dual-clip PPO"), so one huge
    ratio cannot dominate the step.

    Args:
        log_ratio: ``[N, T]`` from :func:`importance_log_ratio`.
        advantages: ``[N]`` one advantage per sequence (broadcast over its tokens) or ``[N, T]``.
        mask: ``[N, T]`` response-token mask.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
        bound = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    valid = mask.bool()
    return PolicyLossTerms(
        loss=loss * mask,
        ratio=ratio,
        clipped_low=(ratio < 1.0 - clip_low) & (advantages < 0) & valid,
        clipped_high=(ratio > 1.0 + clip_high) & (advantages > 0) & valid,
        dual_clipped=dual_clipped & valid,
    )


@dataclass(frozen=True)
class LossNormalizer:
    """Counts over the *whole* rollout batch (all micro-batches, all ranks) that the aggregation
    divides by, so that per-micro-batch losses sum to the full-batch loss."""

    num_tokens: float  # response tokens in the rollout batch
    num_sequences: float  # sequences (prompts x G) in the rollout batch
    max_response_length: int  # Dr.GRPO's constant per-sequence normaliser

    @classmethod
    def of(cls, mask: torch.Tensor, max_response_length: int) -> "LossNormalizer":
        return cls(float(mask.sum().item()), float(mask.shape[0]), max_response_length)


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation, normalizer: LossNormalizer
) -> torch.Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar.

    - ``token_mean``: sum over all tokens / tokens in the rollout batch (DAPO).
    - ``sequence_mean``: mean over sequences of each sequence's token mean (original GRPO).
    - ``constant``: sum over all tokens / (sequences x max response length) (Dr.GRPO), which removes
      GRPO's bias towards long wrong answers.
    """
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(normalizer.num_tokens, 1.0)
    if mode == "sequence_mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(normalizer.num_sequences, 1.0)
    if mode == "constant":
        return masked.sum() / max(normalizer.num_sequences * normalizer.max_response_length, 1.0)
    raise ValueError(f"loss_aggregation must be 'token_mean', 'sequence_mean' or 'constant', got {mode!r}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)
