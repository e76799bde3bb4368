"""How a request is shared among the service's training ranks (``training.devices x num_nodes > 1``) and how their
answers become one: pure functions over ``TrainBatch`` and the ranks' replies, no processes.

Splitting (:func:`split_rows`): the batch's prompt groups (runs of consecutive sequences with the same prompt)
are dealt to the ranks as contiguous blocks, as equal in number as they can be (the first ``groups % ranks``
ranks get one more), the way ``arctic-rl fit`` gives every rank the same number of prompts. A group stays on one
rank, so ZoRRo computes its prompt once. A batch with fewer groups than ranks is split by sequences instead
(gradients are the same; a group's prompt is then computed on each rank that holds part of it); fewer sequences
than ranks cannot be split (every rank must take part in the step's collectives).

Merging: ``forward`` outputs are concatenated in rank order (the batch's order). ``forward_backward``'s answers
combine as the ranks' shares of one global batch (:func:`merge_losses`): the loss is normalised by the global
token and sequence counts on every rank (``LossNormalizer.of(all_ranks=True)``), so the ranks' losses sum to the
batch's; ``num_sequences`` sums; ``num_tokens`` is already global; minima and maxima stay minima and maxima; every
other metric (a mean over a rank's micro-batches) is averaged over the ranks weighted by their sequences.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

import torch

from arctic_rl.modules.step_metrics import is_extreme
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.errors import RequestError

SUMMED = ("loss", "num_sequences")  # the ranks' shares of the global batch's value
GLOBAL = ("num_tokens",)  # the same on every rank (counted over all of them)


def prompt_groups(prompts: list[list[int]]) -> list[range]:
    """Row ranges of the runs of consecutive equal prompts, in order."""
    groups, start = [], 0
    for i in range(1, len(prompts) + 1):
        if i == len(prompts) or prompts[i] != prompts[start]:
            groups.append(range(start, i))
            start = i
    return groups


def _blocks(count: int, ranks: int) -> list[range]:
    """``range(count)`` cut into ``ranks`` contiguous blocks, the first ``count % ranks`` one longer."""
    size, extra = divmod(count, ranks)
    bounds = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [range(bounds[r], bounds[r + 1]) for r in range(ranks)]


def split_rows(prompts: list[list[int]], ranks: int) -> list[list[int]]:
    """Each rank's rows of a batch with these prompts (see the module docstring for the rule).

    Raises:
        RequestError: fewer sequences than ranks.
    """
    if len(prompts) < ranks:
        raise RequestError(f"the batch has {len(prompts)} sequences, but the job's {ranks} training ranks (training.devices"
                           f" x num_nodes) each need at least one; send at least {ranks}")
    groups = prompt_groups(prompts)
    if len(groups) < ranks:  # too few groups: by sequences
        return [list(block) for block in _blocks(len(prompts), ranks)]
    return [[row for g in block for row in groups[g]] for block in _blocks(len(groups), ranks)]


def take_rows(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    """The sequences ``rows`` of ``batch`` (every tensor keeps its width, so the ranks' outputs line up)."""
    index = torch.tensor(rows, dtype=torch.long)
    tensors = {f.name: getattr(batch, f.name)[index] for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, prompt_token_ids=[batch.prompt_token_ids[i] for i in rows], **tensors)


def merge_outputs(outputs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``forward``'s per-rank outputs (each ``{name: [n_r, ...]}``, the rank's rows in order) as one, in batch order."""
    return {name: torch.cat([out[name] for out in outputs]) for name in outputs[0]}


def merge_losses(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """``forward_backward``'s per-rank answers as the global batch's (see the module docstring)."""
    weights = [float(reply["num_sequences"]) for reply in replies]
    merged: dict[str, Any] = {}
    for key, first in replies[0].items():
        values = [reply[key] for reply in replies if key in reply]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) or len(values) != len(replies):
            merged[key] = first  # not a number on every rank (e.g. a flag): rank 0's
        elif key in SUMMED:
            merged[key] = float(sum(values))
        elif key in GLOBAL:
            merged[key] = first
        elif is_extreme(key):
            present = [v for v in values if not math.isnan(v)]
            pick = min if key.endswith(("_min", "/min")) else max
            merged[key] = pick(present) if present else math.nan
        else:
            merged[key] = sum(v * w for v, w in zip(values, weights)) / max(sum(weights), 1.0)
    return merged
