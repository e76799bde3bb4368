"""Weighted sums of a training step's metrics (means over its micro- and mini-batches)."""

from __future__ import annotations

from typing import Any


def accumulate_weighted(sums: dict[str, float], values: dict[str, Any], weight: float) -> None:
    """``sums[key] += weight * value`` for each entry (weighted means over micro/mini-batches)."""
    for key, value in values.items():
        sums[key] = sums.get(key, 0.0) + float(value) * weight
