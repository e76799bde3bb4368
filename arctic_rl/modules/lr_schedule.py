"""The learning-rate schedule: linear warm-up, then constant, linear or cosine decay to 0 over the run.

The decay length is the run's real bound in optimizer steps: ``trainer.max_steps`` and/or
``trainer.max_epochs`` (epochs x batches per epoch x ``mini_batches`` x ``num_iterations``), the smaller
when both are set. A decaying schedule on a run with no such bound (only ``max_time``, or unbounded) is refused
at start: its length is unknown, and guessing it wrong trains at learning rate 0.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Timer

from arctic_rl.errors import ConfigError


def lr_factor(step: int, warmup: int, total: int, schedule: str, min_lr_ratio: float = 0.0, num_cycles: float = 0.5) -> float:
    """Multiplier of the base learning rate at optimizer step ``step`` (0-based), transformers' schedules
    exactly (``get_scheduler``, which TRL uses): warm-up ``step / warmup``, so the first step has
    learning rate 0 and only fills AdamW's moments, then the decay over ``total - warmup`` steps. The cosine
    is verl 0.9.1's ``get_cosine_schedule_with_warmup`` (transformers' for the defaults): ``num_cycles`` waves,
    floored at ``min_lr_ratio``; past ``total`` every schedule keeps its final value."""
    if warmup > 0 and step < warmup:
        return step / warmup
    if schedule == "constant":
        return 1.0
    progress = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":  # verl's coef / intercept form, the same floating-point operations
        x = math.cos(math.pi * float(num_cycles) * 2.0 * progress)
        return max(min_lr_ratio, x * ((1 - min_lr_ratio) * 0.5) + (1 + min_lr_ratio) * 0.5)
    raise ValueError(f"model.optim.lr_schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")


def schedule_length(trainer: pl.Trainer, schedule: str, steps_per_batch: int) -> int:
    """Optimizer steps the run will take (``steps_per_batch`` per rollout batch); 0 for ``constant``,
    which needs none. Raises when a decaying schedule has no step or epoch bound."""
    if schedule == "constant":
        return 0
    bounds = [trainer.max_steps] if trainer.max_steps > 0 else []
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # what Trainer.estimated_stepping_batches does
        if math.isfinite(trainer.num_training_batches):
            bounds.append(int(trainer.num_training_batches) * trainer.max_epochs * steps_per_batch)
    if not bounds:
        timed = any(isinstance(cb, Timer) for cb in trainer.callbacks)
        bound = "only by time (trainer.max_time)" if timed else "by nothing"
        raise ConfigError(
            f"model.optim.lr_schedule={schedule!r} decays over the run's length, but this run is bounded {bound}"
            " (no trainer.max_steps or trainer.max_epochs): set trainer.max_steps (or max_epochs), or use"
            " model.optim.lr_schedule='constant'"
        )
    return min(bounds)
