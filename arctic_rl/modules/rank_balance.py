"""Re-dealing a mini-batch's prompt groups over data-parallel ranks by token load.

:func:`balance_across_ranks` all-gathers every rank's mini-batch and each rank calls the pure
:func:`deal_across_ranks` on the same list, so all ranks reach the same deal without further
communication. The units dealt are ZoRRo's (whole prompt groups, or pieces of groups over the token
budget), largest first, each to the least-loaded rank (``arctic_rl.zorro.plan_micro_batches``). Exact
for training: the loss normalisers are global, so where a group is computed does not change the gradient.
"""

from __future__ import annotations

import torch

from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.zorro import dedup_stats, plan_micro_batches


def max_over_mean_tokens(batches: list[RolloutBatch]) -> float:
    """Largest rank's packed (prompt-deduplicated) tokens over the ranks' mean."""
    loads = [dedup_stats(b.prompt_token_ids, b.sequence_mask).processed_tokens for b in batches]
    return max(loads) / max(sum(loads) / len(loads), 1e-9)


def deal_across_ranks(gathered: list[RolloutBatch], token_budget: int) -> tuple[list[RolloutBatch] | None, dict[str, float]]:
    """Every rank's batch after the deal, or None where the deal is not better balanced than the ranks'
    own batches (or leaves a rank empty); plus ``zorro/rank_tokens_max_over_mean`` before and after."""
    everything = RolloutBatch.concat(gathered)
    lengths = everything.sequence_mask.sum(-1).long().tolist()
    plan = plan_micro_batches(everything.prompt_token_ids, lengths, token_budget, num_ranks=len(gathered))
    rows = [sorted(i for micro in rank_plan for i in micro) for rank_plan in plan]
    before = max_over_mean_tokens(gathered)
    dealt = [everything.take(r) for r in rows] if all(rows) else None
    after = max_over_mean_tokens(dealt) if dealt is not None else before
    if after >= before:  # the deal is a heuristic: keep the ranks' own batches unless it is better
        dealt, after = None, before
    return dealt, {"zorro/rank_tokens_max_over_mean_before": before, "zorro/rank_tokens_max_over_mean": after}


def balance_across_ranks(mini: RolloutBatch, world_size: int, rank: int, token_budget: int) -> tuple[RolloutBatch, dict[str, float]]:
    """This rank's share of every rank's ``mini`` re-dealt by token load, and the imbalance metrics; its
    own ``mini`` where the deal is not better. An all-gather: every rank calls it."""
    gathered: list[RolloutBatch | None] = [None] * world_size
    torch.distributed.all_gather_object(gathered, mini.to("cpu"))
    dealt, metrics = deal_across_ranks(gathered, token_budget)
    if dealt is None:
        return mini, metrics
    return dealt[rank].to(mini.response_ids.device), metrics
