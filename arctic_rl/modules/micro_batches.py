"""Planning the forward/backward passes over a batch: which rows each micro-batch holds, and the same
number of passes on every rank (ZeRO-3's parameter gathers are collectives)."""

from __future__ import annotations

import torch

from arctic_rl.rollout.batch import RolloutBatch


def micro_batch_rows(batch: RolloutBatch, micro_batch_size: int | None, micro_batch_tokens: int | None) -> list[list[int]]:
    """Row indices of each micro-batch: ``micro_batch_tokens`` packs ZoRRo units (whole prompt groups, or
    pieces of groups over the budget) into token budgets; else runs of ``micro_batch_size`` rows (None: all)."""
    n = batch.num_sequences
    if micro_batch_tokens is not None:
        from arctic_rl.zorro import plan_micro_batches
        from arctic_rl.zorro.packing import response_extents

        lengths = response_extents(batch.sequence_mask)  # every token the forward reads (multi-turn: observations too)
        return [m for m in plan_micro_batches(batch.prompt_token_ids, lengths, micro_batch_tokens)[0] if m]
    step = micro_batch_size or n
    return [list(range(s, min(s + step, n))) for s in range(0, n, step)]


def pad_across_ranks(plan: list[list[int]], device: torch.device) -> list[list[int]]:
    """``plan`` with empty micro-batches appended up to the longest plan of any rank (a collective)."""
    count = torch.tensor([len(plan)], device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return plan + [[]] * (int(count.item()) - len(plan))
