"""Advantage estimators for group-sampled rollouts, as pure functions.

``rewards`` is ``[N]`` with the G samples of each prompt contiguous (``N = num_prompts * G``).
"""

from __future__ import annotations

import torch

from arctic_rl.options.rollout import AdvantageEstimator, RewardScaling


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: AdvantageEstimator, scale: RewardScaling = "group", eps: float = 1e-4
) -> torch.Tensor:
    """One advantage per sequence, computed within its group of ``group_size`` samples.

    - ``grpo``: ``(r - mean_g) / (std + eps)`` with the unbiased std of the group (Shao et al. 2024),
      of the whole batch (``scale="batch"``), or no division (``scale="none"``) — TRL's ``scale_rewards``.
    - ``dr_grpo``: ``r - mean_g``, no std scaling (Liu et al. 2025, "Understanding R1-Zero").
    - ``rloo``: ``r_i - mean_{j != i} r_j`` (Ahmadian et al. 2024), the leave-one-out baseline.

    A group whose rewards are all equal gets zero advantages under every estimator.

    Raises:
        ValueError: if ``rewards`` has a non-finite entry (named by index) or its length is not a
            multiple of ``group_size``.
    """
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be 1-D with a length divisible by group_size={group_size}, got shape {tuple(rewards.shape)}")
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"rewards are not finite at samples {bad}: {rewards[bad].tolist()}")
    grouped = rewards.view(-1, group_size).to(torch.float64)
    mean = grouped.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        if scale == "group":
            adv = (grouped - mean) / (grouped.std(dim=1, keepdim=True) + eps)
        elif scale == "batch":
            adv = (grouped - mean) / (grouped.std() + eps)
        elif scale == "none":
            adv = grouped - mean
        else:
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale!r}")
    elif estimator == "dr_grpo":
        adv = grouped - mean
    elif estimator == "rloo":
        adv = (grouped - mean) * group_size / (group_size - 1)
    else:
        raise ValueError(f"advantage_estimator must be 'grpo', 'dr_grpo' or 'rloo', got {estimator!r}")
    return adv.flatten().to(rewards.dtype)
