"""Token-budget micro-batching of prompt groups, balanced across data-parallel ranks (pure functions).

A ZoRRo micro-batch must hold whole prompt groups, or the prompt is computed once per piece. The
planner therefore works on *units*: a whole group when ``P + sum |R_i|`` fits the token budget,
else sub-groups that each repeat the prompt and fit. Units are dealt to ranks largest first, each
to the least-loaded rank (LPT), then packed per rank into micro-batches first-fit-decreasing.
Every rank gets the same number of micro-batches (collectives in backward must match); a rank
with too few units gets empty micro-batches (``[]``), which the caller runs as a zero-loss step.
"""

from __future__ import annotations

from dataclasses import dataclass

from arctic_rl.zorro.packing import group_by_prompt


@dataclass(frozen=True)
class Unit:
    """Samples packed together with one copy of their shared prompt."""

    samples: tuple[int, ...]
    tokens: int  # P + sum of the samples' response lengths


def split_group(prompt_length: int, samples: list[int], lengths: list[int], token_budget: int) -> list[Unit]:
    """Greedily cut one prompt group into units of at most ``token_budget`` tokens, in sample order."""
    units, current, used = [], [], prompt_length
    for i in samples:
        if prompt_length + lengths[i] > token_budget:
            raise ValueError(
                f"sample {i}: prompt ({prompt_length}) + response ({lengths[i]}) tokens exceed the ZoRRo token "
                f"budget {token_budget}; raise the budget"
            )
        if current and used + lengths[i] > token_budget:
            units.append(Unit(tuple(current), used))
            current, used = [], prompt_length
        current.append(i)
        used += lengths[i]
    units.append(Unit(tuple(current), used))
    return units


def plan_micro_batches(
    prompt_token_ids: list[list[int]], lengths: list[int], token_budget: int, num_ranks: int = 1
) -> list[list[list[int]]]:
    """Plan ``[rank][micro_batch] -> sample indices`` so that each micro-batch packs to at most
    ``token_budget`` tokens and ranks carry about the same number of tokens.

    Args:
        prompt_token_ids: N prompts (identical prompts are one group, wherever they are).
        lengths: N response lengths.
        token_budget: most packed tokens per micro-batch.
        num_ranks: data-parallel ranks to balance over.
    """
    if token_budget < 1 or num_ranks < 1:
        raise ValueError(f"token_budget ({token_budget}) and num_ranks ({num_ranks}) must be >= 1")
    units = []
    for group in group_by_prompt(prompt_token_ids):
        units += split_group(len(prompt_token_ids[group[0]]), group, lengths, token_budget)
    units.sort(key=lambda u: (-u.tokens, u.samples))
    per_rank: list[list[Unit]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    for unit in units:
        rank = min(range(num_ranks), key=lambda k: (loads[k], k))
        per_rank[rank].append(unit)
        loads[rank] += unit.tokens
    plans = [first_fit_decreasing(rank_units, token_budget) for rank_units in per_rank]
    count = max(len(plan) for plan in plans)
    return [plan + [[] for _ in range(count - len(plan))] for plan in plans]


def first_fit_decreasing(units: list[Unit], token_budget: int) -> list[list[int]]:
    """Bins of at most ``token_budget`` tokens; each bin's sample indices sorted ascending."""
    bins: list[list[Unit]] = []
    room: list[int] = []
    for unit in sorted(units, key=lambda u: (-u.tokens, u.samples)):
        slot = next((b for b, free in enumerate(room) if free >= unit.tokens), None)
        if slot is None:
            bins.append([])
            room.append(token_budget)
            slot = len(bins) - 1
        bins[slot].append(unit)
        room[slot] -= unit.tokens
    return [sorted(i for unit in b for i in unit.samples) for b in bins]
