"""GRPO-family policy losses as pure functions over tensors, with TRL's meanings (TRL 1.16
``GRPOTrainer._compute_loss``): the same ``loss_type`` names, formulas and logged metric names.

Shapes: ``N`` sequences (prompts x G), ``T`` response positions (right-padded), ``mask [N, T]`` is 1.0
on real response tokens. With ``importance_sampling_level="sequence"`` the importance weight is one
value per sequence, ``[N, 1]``, and broadcasts over its tokens.

Normalisers are passed in, not computed from the micro-batch: a token-mean loss over a batch split
into micro-batches (or data-parallel ranks) divides each piece's token sum by the token count of the
*whole* batch, so the pieces' losses sum exactly to the full-batch loss. ``tests/modules/test_losses.py``
checks every function against hand-computed values and TRL's formulas. ``LossInputs`` is what every registered
loss (``loss_registry.py``) gets for one micro-batch. The ``loss`` and ``regularizers`` option sections
(``LossConfig``, ``Regularizers``) are ``arctic_rl/options/loss.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from arctic_rl.loss_registry import LossAggregation, LossInputError
from arctic_rl.modules.corrections import PolicyWeights
from arctic_rl.options.loss import (AGGREGATIONS, KL_ESTIMATORS, EntropyAggregation, ImportanceSamplingLevel, KLEstimator,
                                    LossConfig, Regularizers)  # the option sections, here under their former path too

CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# the losses policy_objective computes; builtin_losses.py registers each, with its normaliser
GRPO_FAMILY = (*CLIPPED_LOSSES, "cispo", "sapo", "vespo")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL").

    With ``log_r = logprobs - ref_logprobs``: k1 = log_r; k2 = log_r**2 / 2; k3 = exp(-log_r) - 1 + log_r
    (unbiased, always >= 0; GRPO's and TRL's choice); abs = |log_r|; low_var_kl = verl's k3, with ``-log_r``
    clamped to [-20, 20] and the result to [-10, 10]. A ``+`` suffix (verl's straight-through variants) keeps
    the value of the estimator it names and takes the gradient of k2 (unbiased for KL's gradient).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {', '.join(map(repr, KL_ESTIMATORS))}, got {estimator!r}")
    log_ratio = logprobs - ref_logprobs
    if estimator.endswith("+"):
        forward, k2 = kl_penalty(logprobs, ref_logprobs, estimator[:-1]), 0.5 * log_ratio.square()
        return k2 - k2.detach() + forward.detach()
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1.0 + log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    neg = torch.clamp(ref_logprobs - logprobs, min=-20.0, max=20.0)  # low_var_kl, verl's order of operations
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


def importance_log_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: ImportanceSamplingLevel
) -> torch.Tensor:
    """``log(pi / pi_old)``: per token ``[N, T]``, or the sequence's length-normalised log ratio
    ``[N, 1]`` (``level="sequence"``, GSPO, Zheng et al. 2025)."""
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")


def ratio_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """TRL's metric mean: over masked tokens for ``[N, T]`` values, over sequences for ``[N, 1]``."""
    if values.shape[-1] == 1 and mask.shape[-1] != 1:
        return values.float().mean()
    return masked_mean(values.float(), mask)


def sequence_extreme(values: torch.Tensor, mask: torch.Tensor, reduce) -> torch.Tensor:
    """TRL's ``clip_ratio/low_min`` / ``high_max``: ``reduce`` (torch.min or torch.max) over sequences of
    each sequence's masked mean of ``values`` (``[N, 1]``: the value itself); sequences without a masked
    token are skipped (TRL's NaN under nanmin/nanmax); NaN when none is left."""
    if values.shape[-1] == 1 and mask.shape[-1] != 1:
        per_seq = values.float().flatten()
    else:
        counts = mask.sum(-1)
        per_seq = ((values.float() * mask).sum(-1) / counts.clamp(min=1.0))[counts > 0]
    return reduce(per_seq) if per_seq.numel() else per_seq.new_tensor(float("nan"))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass
class PolicyTerms:
    """The unaggregated policy objective and what it reports."""

    per_token: torch.Tensor  # [N, T] or [N, 1]: loss to minimise, before masking and aggregation
    ratio: torch.Tensor  # [N, T] or [N, 1]: importance weight pi / pi_old (with grad)
    metrics: dict[str, torch.Tensor]  # TRL's names: clip_ratio/*, cispo_clip_ratio, vespo/phi_seq_mean


def policy_objective(
    cfg: LossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    sampler_weights: torch.Tensor | None = None,
) -> PolicyTerms:
    """Per-token policy loss of ``cfg.loss_type``.

    - grpo/bnpo/dr_grpo/dapo/luspo: PPO's clipped surrogate ``-min(r A, clip(r, 1-lo, 1+hi) A)``,
      with ``r`` capped at ``dual_clip`` when set (TRL's ``delta``; dual-clip PPO for A < 0).
    - cispo: ``-sg(min(r, cispo_max_ratio)) A log pi``: clips the weight, never drops a token's gradient.
    - sapo: ``-sigmoid(tau (r - 1)) 4/tau A``: a soft, temperature-controlled gate instead of a hard clip.
    - vespo: ``-sg(phi(w)) A log pi`` with ``phi(w) = e^lam w^k e^{-lam w}`` of the sequence ratio ``w``.

    Args:
        logprobs: ``[N, T]`` current policy log-probs (with grad).
        old_logprobs: ``[N, T]`` policy that generated / before this batch's updates.
        advantages: ``[N]`` or ``[N, T]``.
        mask: ``[N, T]``.
        sampler_weights: VESPO only: the token-level mismatch correction ``pi_old / pi_sampler`` folded into
            its sequence weight (TRL's ``get_gamma_weights``); other losses are multiplied by it in ``grpo_family_loss``.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = importance_log_ratio(logprobs, old_logprobs, mask, cfg.importance_sampling_level)
    ratio = torch.exp(log_ratio)
    metrics: dict[str, torch.Tensor] = {}
    if cfg.loss_type in CLIPPED_LOSSES:
        clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
        capped = ratio if cfg.dual_clip is None else torch.clamp(ratio, max=cfg.dual_clip)
        per_token = -torch.minimum(capped * advantages, clipped * advantages)
        low = (capped < 1.0 - cfg.clip_low) & (advantages < 0)
        high = (capped > 1.0 + cfg.clip_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"] = ratio_mean(low, mask)
        metrics["clip_ratio/high_mean"] = ratio_mean(high, mask)
        metrics["clip_ratio/region_mean"] = ratio_mean(low | high, mask)
        metrics["clip_ratio/low_min"] = sequence_extreme(low, mask, torch.min)
        metrics["clip_ratio/high_max"] = sequence_extreme(high, mask, torch.max)
    elif cfg.loss_type == "cispo":
        weight = torch.clamp(ratio, max=cfg.cispo_max_ratio).detach()
        per_token = -weight * advantages * logprobs
        metrics["cispo_clip_ratio"] = ratio_mean((ratio > cfg.cispo_max_ratio) & (advantages > 0), mask)
    elif cfg.loss_type == "sapo":
        tau = torch.where(advantages > 0, advantages.new_tensor(cfg.sapo_temperature_pos), advantages.new_tensor(cfg.sapo_temperature_neg))
        per_token = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
    elif cfg.loss_type == "vespo":
        phi = vespo_gamma_weights(cfg, logprobs - old_logprobs, advantages, mask, sampler_weights)
        per_token = -phi * advantages * logprobs
        metrics["vespo/phi_seq_mean"] = phi.mean()
    else:
        raise ValueError(f"unknown loss_type {cfg.loss_type!r}")
    return PolicyTerms(per_token=per_token, ratio=ratio, metrics=metrics)


@torch.no_grad()
def vespo_gamma_weights(cfg: LossConfig, log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        sampler_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's per-sequence weight ``phi(w) = exp(lam + k log w - lam w)`` (so ``phi(1) = 1``), where
    ``log w`` is the sequence's *summed* token log ratio, clamped to ``[log 1e-8, 20]``; ``k, lam``
    depend on the advantage's sign. With ``sampler_weights`` (token-level mismatch correction ``[N, T]``),
    ``log w`` also sums their logs, each clamped to ``[log 1e-8, 20]`` (TRL). Detached: it only scales the
    gradient. Returns ``[N, 1]``."""
    seq_log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if sampler_weights is not None:
        seq_log_w = seq_log_w + (torch.clamp(torch.log(sampler_weights), math.log(1e-8), 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq_log_w, math.log(1e-8), 20.0)
    nonneg = advantages[:, :1] >= 0
    k = torch.where(nonneg, log_w.new_tensor(cfg.vespo_k_pos), log_w.new_tensor(cfg.vespo_k_neg))
    lam = torch.where(nonneg, log_w.new_tensor(cfg.vespo_lambda_pos), log_w.new_tensor(cfg.vespo_lambda_neg)).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@dataclass(frozen=True)
class LossNormalizer:
    """Counts over the *whole* batch that one optimizer step covers (all micro-batches, all ranks)."""

    num_tokens: float  # response tokens
    num_sequences: float  # sequences (prompts x G)
    max_response_length: int  # Dr.GRPO's constant per-sequence normaliser
    num_selected_tokens: float | None = None  # top_entropy_quantile: tokens selected (the entropy bonus's count)

    @classmethod
    def of(cls, mask: torch.Tensor, max_response_length: int, all_ranks: bool = False) -> "LossNormalizer":
        """Counts of ``mask [N, T]``; with ``all_ranks``, summed over the default process group."""
        counts = torch.tensor([mask.sum().item(), float(mask.shape[0])], dtype=torch.float64)
        if all_ranks:
            torch.distributed.all_reduce(counts)
        return cls(counts[0].item(), counts[1].item(), max_response_length)


@dataclass(frozen=True)
class LossInputs:
    """What a loss gets for one micro-batch; shapes are checked on construction (``LossInputError``)."""

    logprobs: torch.Tensor  # [N, T] current policy log-probs (with grad)
    old_logprobs: torch.Tensor  # [N, T] policy before this batch's updates (the ratio's denominator)
    advantages: torch.Tensor  # [N] (or [N, T]: per token)
    mask: torch.Tensor  # [N, T] 1.0 on the tokens that count
    normalizer: LossNormalizer  # counts of the whole batch one optimizer step covers
    ref_logprobs: torch.Tensor | None = None  # [N, T] frozen reference policy (when the loss needs it)
    entropy: torch.Tensor | None = None  # [N, T] policy entropy per position (when the loss needs it)
    weights: PolicyWeights | None = None  # factors on the per-token policy loss (fit's corrections), or None
    sampler_logprobs: torch.Tensor | None = None  # [N, T] the rollout engine's log-probs, when known

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        if len(shape) != 2:
            raise LossInputError(f"mask: expected [n, R], got shape {shape}")
        check_shape("advantages", self.advantages, (shape, shape[:1]))
        for name, tensor in (("logprobs", self.logprobs), ("old_logprobs", self.old_logprobs),
                             ("ref_logprobs", self.ref_logprobs), ("entropy", self.entropy),
                             ("sampler_logprobs", self.sampler_logprobs)):
            if tensor is not None:
                check_shape(name, tensor, (shape,))


def check_shape(name: str, tensor: torch.Tensor, allowed: Iterable[tuple[int, ...]]) -> None:
    """Raise ``LossInputError`` naming ``name`` unless ``tensor``'s shape is one of ``allowed``."""
    allowed = list(allowed)
    if tuple(tensor.shape) not in allowed:
        raise LossInputError(f"{name}: expected shape {' or '.join(str(list(s)) for s in allowed)}, got {list(tensor.shape)}")



def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: LossAggregation, normalizer: LossNormalizer
) -> torch.Tensor:
    """Reduce a ``[N, T]`` (or ``[N, 1]``) per-token loss to a scalar over the masked tokens.

    - ``token_mean``: sum over tokens / tokens in the batch (DAPO, CISPO, VESPO; BNPO).
    - ``sequence_mean``: mean over sequences of each sequence's token mean (GRPO, SAPO).
    - ``sequence_sum``: mean over sequences of each sequence's token sum (LUSPO).
    - ``constant``: sum over tokens / (sequences x max response length) (Dr.GRPO).
    """
    masked = per_token * mask
    if mode == "token_mean":
        return masked.sum() / max(normalizer.num_tokens, 1.0)
    if mode == "sequence_mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / max(normalizer.num_sequences, 1.0)
    if mode == "sequence_sum":
        return masked.sum() / max(normalizer.num_sequences, 1.0)
    if mode == "constant":
        return masked.sum() / max(normalizer.num_sequences * normalizer.max_response_length, 1.0)
    raise ValueError(f"loss_aggregation must be one of {sorted(AGGREGATIONS)}, got {mode!r}")


def grpo_family_loss(
    cfg: LossConfig,
    aggregation: LossAggregation,
    regularizers: Regularizers,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normalizer: LossNormalizer,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    weights: PolicyWeights | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch's loss, normalised by the whole batch's ``normalizer`` (so micro-batch losses sum
    to the batch loss): the policy objective (times ``weights``' factors, in TRL's order), plus ``kl_coef``
    x KL when ``ref_logprobs`` is given, minus ``entropy_coef`` x the entropy aggregated by ``entropy_bonus`` when
    ``entropy`` is given. The built-in losses (``builtin_losses.family_loss``), which ``fit``, the service and
    the TRL adapter look up by name, call this. Returns ``(loss, stats)`` (token means, TRL's names)."""
    weights = weights or PolicyWeights()
    is_vespo = cfg.loss_type == "vespo"
    terms = policy_objective(cfg, logprobs, old_logprobs, advantages, mask, weights.importance if is_vespo else None)
    per_token, stats = terms.per_token, dict(terms.metrics)
    for factor in (weights.off_policy, weights.entropy, None if is_vespo else weights.importance):
        if factor is not None:
            per_token = per_token * factor
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, regularizers.kl_estimator)
        if regularizers.kl_bias_correction:
            kl = kl * terms.ratio
        per_token = per_token + regularizers.kl_coef * kl
        stats["kl"] = ratio_mean(kl.detach(), mask)
    loss = aggregate_loss(per_token, mask, aggregation, normalizer)
    if entropy is not None:
        loss = loss - regularizers.entropy_coef * entropy_bonus(entropy, mask, regularizers.entropy_aggregation,
                                                                aggregation, normalizer, weights.entropy)
    return loss, stats


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, mode: EntropyAggregation, aggregation: LossAggregation,
                  normalizer: LossNormalizer, selected: torch.Tensor | None = None) -> torch.Tensor:
    """The aggregated entropy the loss subtracts (times ``entropy_coef``): ``token_mean`` (TRL: over the batch's
    tokens, or the ``selected`` ones of ``top_entropy_quantile``, whatever the loss's normaliser) or ``loss``
    (the loss's ``aggregation``, verl's ``agg_loss(entropy, loss_agg_mode)``; not with a token selection)."""
    if mode == "loss":
        if selected is not None:
            raise ValueError("entropy_aggregation 'loss' does not combine with top_entropy_quantile's token selection")
        return aggregate_loss(entropy, mask, aggregation, normalizer)
    if selected is None:
        return (entropy * mask).sum() / max(normalizer.num_tokens, 1.0)
    return (entropy * mask * selected).sum() / max(normalizer.num_selected_tokens, 1.0)
