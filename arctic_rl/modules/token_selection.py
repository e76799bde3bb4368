"""``top_entropy_quantile`` (TRL's meaning; Wang et al. 2025, "Beyond the 80/20 Rule", arXiv 2506.01939):
train the policy term only on the tokens whose entropy is in the top quantile of the batch.

TRL takes the quantile over one micro-batch gathered from all ranks; here it is taken over the whole
mini-batch of an optimizer step on every rank (``entropy_threshold`` with ``all_ranks``), so the selection,
like the loss normalisers, does not depend on how the batch is split.
"""

from __future__ import annotations

import torch


def linear_quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation between the two nearest order statistics) over
    a 1-d tensor, by sorting: torch.quantile refuses inputs of more than 2**24 elements."""
    ordered = torch.sort(values.flatten().double()).values
    pos = (ordered.numel() - 1) * q
    lo, hi = int(pos // 1), min(int(pos // 1) + 1, ordered.numel() - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _gather_from_ranks(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-d ``values`` concatenated (ranks may hold different counts)."""
    count = torch.tensor([values.numel()], device=values.device)
    counts = [torch.zeros_like(count) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(counts, count)
    width = int(max(c.item() for c in counts))
    padded = torch.nn.functional.pad(values, (0, width - values.numel()))
    parts = [torch.zeros_like(padded) for _ in counts]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[: int(c.item())] for part, c in zip(parts, counts)])


@torch.no_grad()
def entropy_threshold(entropies: torch.Tensor, mask: torch.Tensor, top_quantile: float, all_ranks: bool = False) -> float | None:
    """The entropy at the ``1 - top_quantile`` quantile of the masked tokens of ``entropies [N, T]``
    (TRL's ``get_high_entropy_mask`` threshold), taken over every rank's tokens with ``all_ranks``.
    None when no token is masked in (nothing to select)."""
    values = entropies[mask.bool()].double()
    if all_ranks:
        values = _gather_from_ranks(values)
    if values.numel() == 0:
        return None
    return float(linear_quantile(values, 1.0 - top_quantile))


def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, threshold: float | None) -> torch.Tensor:
    """1.0 on masked tokens whose entropy is >= ``threshold`` (TRL: ``entropies * mask >= threshold``, and
    within ``mask``), else 0.0; all 0 for a None threshold. ``[N, T]`` in ``mask``'s dtype."""
    if threshold is None:
        return torch.zeros_like(mask)
    return ((entropies.detach() * mask >= threshold) & mask.bool()).to(mask.dtype)
