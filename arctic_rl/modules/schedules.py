"""Learning-rate schedules as pure functions of the optimizer step."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the base learning rate at optimizer step ``step``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"model.lr_schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")
