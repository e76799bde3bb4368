"""Checks ``arctic-rl fit`` makes before anything expensive starts: the checkpoint to resume from
(right after parsing, before LightningCLI reads its hyperparameters), then the run's checkpoint
directory and whether the strategy can run the requested number of processes.

Each failure is a :class:`~arctic_rl.errors.ConfigError`: one line naming what to change.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from arctic_rl.errors import ConfigError

SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")  # Lightning looks these up itself


def check_fit(trainer: pl.Trainer, ckpt_path: str | None) -> None:
    """The checks that need the Trainer, before ``fit`` starts."""
    check_strategy(trainer)
    check_rerun(trainer, ckpt_path)


def check_strategy(trainer: pl.Trainer) -> None:
    """More than one training process needs ``ArcticStrategy``: ``GRPOModule`` makes several backward
    passes and optimizer steps per ``training_step``, which DDP's reducer cannot follow."""
    from arctic_rl.strategies import ArcticStrategy

    processes = len(trainer.device_ids) * trainer.num_nodes
    if processes > 1 and not isinstance(trainer.strategy, ArcticStrategy):
        raise ConfigError(
            f"trainer.devices={len(trainer.device_ids)} x trainer.num_nodes={trainer.num_nodes} training processes need"
            f" trainer.strategy: arctic_rl.strategies.ArcticStrategy (got {type(trainer.strategy).__name__})"
        )


def check_checkpoint(ckpt_path: str | None) -> None:
    """``ckpt_path`` exists and each file of it is a complete ``torch.save`` archive (a zip whose
    central directory, written last, is present): a truncated or garbage file is named as corrupt
    here instead of failing inside ``torch.load`` with ``EOFError`` or ``KeyError``. A directory
    (DeepSpeed) must hold at least one ``.pt`` file, and each is checked. None and Lightning's names
    (``last``, ``best``, ...) pass."""
    if ckpt_path is None or ckpt_path in SPECIAL_CKPT_PATHS:
        return
    path = Path(ckpt_path)
    if not path.exists():
        raise ConfigError(f"--ckpt_path {ckpt_path} does not exist")
    files = [path] if path.is_file() else sorted(path.rglob("*.pt"))
    if not files:
        raise ConfigError(f"--ckpt_path {ckpt_path} is corrupt: the checkpoint directory holds no .pt files")
    for file in files:
        size = file.stat().st_size
        if size == 0 or not zipfile.is_zipfile(file):
            raise ConfigError(
                f"--ckpt_path {ckpt_path}: {file} is corrupt ({size} bytes, not a complete torch.save archive);"
                " resume from an earlier checkpoint"
            )


def check_rerun(trainer: pl.Trainer, ckpt_path: str | None) -> None:
    """A fresh run must not write into a checkpoint directory that already holds another run's
    checkpoints: ModelCheckpoint would then write ``last-v1.ckpt`` next to the old ``last.ckpt``, and
    the documented resume command (``--ckpt_path <dir>/last.ckpt``) would pick the old run. Resuming
    from a checkpoint of that directory continues its run and is allowed."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            continue  # no dirpath: Lightning puts checkpoints in the logger's new version directory
        directory = Path(callback.dirpath)
        existing = sorted(p.name for p in directory.glob(f"*{callback.FILE_EXTENSION}")) if directory.is_dir() else []
        if not existing:
            continue
        if ckpt_path in SPECIAL_CKPT_PATHS or (
            ckpt_path is not None and Path(ckpt_path).absolute().parent.resolve() == directory.resolve()
        ):
            continue
        shown = ", ".join(existing[:3]) + (f", ... ({len(existing)} files)" if len(existing) > 3 else "")
        resume = f"--ckpt_path {directory / 'last.ckpt'}" if "last.ckpt" in existing else f"--ckpt_path {directory}/<file>"
        raise ConfigError(
            f"{directory} already holds checkpoints of an earlier run ({shown}); this run would mix its checkpoints"
            f" with them. Resume that run with {resume}, or start a new one in another directory (the"
            f" ModelCheckpoint dirpath) or after deleting {directory}"
        )
