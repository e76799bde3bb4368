"""``RunSummary``: one line at the end of ``fit`` saying what happened and where things are."""

from __future__ import annotations

import os

import time
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint


def run_log_dir(trainer: pl.Trainer) -> Path:
    """``trainer.log_dir`` without its broadcast (safe to call on one rank)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not trainer.loggers:
        return Path(trainer.default_root_dir)
    logger = trainer.loggers[0]
    return Path(logger.log_dir if isinstance(logger, (CSVLogger, TensorBoardLogger)) else logger.save_dir)


def _shown(path) -> str:
    """``path`` relative to the working directory when it lies inside it (config paths are made absolute). Links are
    not followed: a ZeRO checkpoint's name links to the hidden directory it was written to (``atomic_checkpoints.py``)."""
    try:
        return str(Path(os.path.abspath(path)).relative_to(Path(os.path.abspath(Path.cwd()))))
    except ValueError:
        return str(path)


class RunSummary(pl.Callback):
    """Prints ``steps, wall time, reward <first 10 steps> -> <last 10 steps>, checkpoint, logs``."""

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self.rewards: list[float] = []
        self.started = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.rewards.append(float(batch["rollout_metrics"]["reward/mean"]))

    def summary_line(self, trainer: pl.Trainer) -> str:
        w = self.window
        first = sum(self.rewards[:w]) / max(len(self.rewards[:w]), 1)
        last = sum(self.rewards[-w:]) / max(len(self.rewards[-w:]), 1)
        ckpt = trainer.checkpoint_callback
        where = ckpt.last_model_path or ckpt.best_model_path or ckpt.dirpath if isinstance(ckpt, ModelCheckpoint) else "none"
        return (
            f"arctic-rl: {trainer.global_step} steps in {time.perf_counter() - self.started:.0f}s | "
            f"reward {first:.3f} -> {last:.3f} (mean of first/last {w} steps) | "
            f"checkpoint: {_shown(where) if where else 'none'} | logs: {_shown(run_log_dir(trainer))}"
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module) -> None:
        if trainer.is_global_zero and self.rewards:
            print(self.summary_line(trainer), flush=True)
