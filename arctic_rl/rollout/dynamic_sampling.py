"""DAPO's dynamic sampling (Yu et al. 2025, arXiv 2503.14476, section 3.2; verl's ``algorithm.filter_groups``):
drop the prompt groups whose rewards are all equal (zero advantage: no policy gradient) and sample more
prompts until the step's batch is full of informative groups again.

Where the extra prompts come from: round ``r >= 1`` draws ``batch_size`` prompts from the training set,
uniformly, skipping prompts already in this step's batch, in an order fixed by (data seed, step, round,
rank); each samples with the seed of (model seed, step, slot, round) (``rollout/engines/seeds.py``). verl pulls the
dataloader's next batches instead; here Lightning's loop owns the dataloader (one batch a step), so
drawing aside leaves the epoch length, the data order and the resume position as they are, and a
resumed run draws the same extra prompts and samples. Informative groups beyond the batch are dropped
(as verl does).

When ``max_num_gen_batches`` rounds do not fill the batch (verl raises an error there), the batch is
completed with dropped groups, in sampling order, and the step logs how many
(``dynamic_sampling/padded_groups``): they carry zero advantage, so they add no policy gradient, but
every step keeps its batch shape. An error would stop the run for good: its resume meets the same
prompts with the same seeds at the same step.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from arctic_rl.data.prompts import PROMPT_IDS, collate_rows
from arctic_rl.options.rollout import DynamicSampling  # the option section, here under its former path too
from arctic_rl.rollout.scored import ScoredGroups
from arctic_rl.rollout.engines.seeds import mix_seed


def informative(rewards: torch.Tensor, group_size: int) -> list[bool]:
    """Per prompt group: whether its rewards differ (verl keeps groups with std > 0)."""
    grouped = rewards.view(-1, group_size)
    return (grouped != grouped[:, :1]).any(dim=1).tolist()


def fill_batch(first: ScoredGroups, sample_round: Callable[[int], ScoredGroups],
               max_rounds: int) -> tuple[ScoredGroups, dict[str, float]]:
    """``first.num_groups`` informative groups: ``first``'s, then those of ``sample_round(1)``,
    ``sample_round(2)``, ... up to ``max_rounds`` rounds in all; short of that, padded with dropped
    groups. Returns the batch and its ``dynamic_sampling/*`` metrics."""
    need, kept, dropped, rounds, current = first.num_groups, [], [], 0, first
    while True:
        rounds += 1
        keep = informative(current.rewards, current.group_size)
        kept.append(current.take_groups([i for i, k in enumerate(keep) if k]))
        dropped.append(current.take_groups([i for i, k in enumerate(keep) if not k]))
        have = sum(part.num_groups for part in kept)
        if have >= need or rounds >= max_rounds:
            break
        current = sample_round(rounds)
    padded = max(need - have, 0)
    batch = ScoredGroups.concat(kept + dropped).take_groups(list(range(need)))
    sampled = sum(p.num_groups for p in kept + dropped)
    return batch, {
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/dropped_groups": float(sum(p.num_groups for p in dropped)),
        "dynamic_sampling/padded_groups": float(padded),
        "dynamic_sampling/informative_frac": have / sampled,
    }


def refill_prompts(rows: list[dict], in_batch: list[list[int]], count: int, seed: int, step: int,
                   sampling_round: int, rank: int) -> dict[str, list]:
    """``count`` training rows (collated like a dataloader batch) for round ``sampling_round`` of step
    ``step`` on ``rank``: a shuffled order fixed by these, skipping prompts ``in_batch`` (token ids)
    while enough others remain."""
    order = list(range(len(rows)))
    random.Random(mix_seed(seed, step, sampling_round, rank)).shuffle(order)
    used = {tuple(ids) for ids in in_batch}
    fresh = [i for i in order if tuple(rows[i][PROMPT_IDS]) not in used]
    picked = (fresh + [i for i in order if tuple(rows[i][PROMPT_IDS]) in used])[:count]
    return collate_rows([rows[i] for i in picked])
