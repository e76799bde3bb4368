"""Checks ``arctic-rl fit`` makes before anything expensive starts: the checkpoint to resume from
(right after parsing, before LightningCLI reads its hyperparameters), then the run's checkpoint
directory, whether the strategy can run the requested number of processes, whether the run's
directories and ``$TMPDIR`` can be written, and the rollout engine's ``engine_kwargs``.

Each failure is a :class:`~arctic_rl.errors.ConfigError`: one line naming what to change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from arctic_rl.errors import ConfigError, UnwritablePath

SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")  # Lightning looks these up itself


def check_fit(trainer: pl.Trainer, ckpt_path: str | None, model: pl.LightningModule | None = None) -> None:
    """The checks that need the Trainer (and the module, when given), before ``fit`` starts."""
    check_strategy(trainer)
    check_zero_stage(trainer)
    lora = getattr(model, "lora_options", None)
    if lora is not None:  # LoRA with ZeRO-3: refused before the process group or any model starts
        from arctic_rl.modules.lora import check_lora_strategy

        check_lora_strategy(lora, trainer.strategy)
    check_rerun(trainer, ckpt_path)
    check_run_dirs(trainer)
    check_temp_dir()
    check_engine_settings(trainer)
    if model is not None:
        check_attention_backend(trainer, model)


def check_attention_backend(trainer: pl.Trainer, model: pl.LightningModule) -> None:
    """A ZoRRo attention backend that needs CUDA, on a run that trains elsewhere: refused before any model starts
    (FlexAttention has no backward on CPU; the cascades are CUDA kernels)."""
    from arctic_rl.modules.policy_module import PolicyModule

    if not isinstance(model, PolicyModule):
        return
    backend, device = model.options.compute.attention_backend, trainer.strategy.root_device.type
    if backend in ("flex", "cudnn", "flash_varlen") and device != "cuda":
        raise ConfigError(f"model.compute.attention_backend {backend!r} needs a CUDA device (FlexAttention has no backward on "
                          f"CPU; the cascades are CUDA kernels), but this run trains on {device} (trainer.accelerator): use "
                          "auto (FlexAttention on GPU, masked SDPA elsewhere) or sdpa")


def check_engine_settings(trainer: pl.Trainer) -> None:
    """Each ``RolloutCallback``'s ``engine_kwargs`` against the keys its engine takes, before it starts."""
    from arctic_rl.rollout.callback import RolloutCallback
    from arctic_rl.rollout.engines.factory import check_engine_kwargs

    for callback in trainer.callbacks:
        if isinstance(callback, RolloutCallback):
            check_engine_kwargs(callback.engine_kind, callback.engine_kwargs)


def run_dirs(trainer: pl.Trainer) -> dict[str, Path]:
    """The directories a run writes, by the setting that names them."""
    dirs = {"trainer.default_root_dir": Path(trainer.default_root_dir)}
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            dirs["the ModelCheckpoint dirpath"] = Path(callback.dirpath)
    for logger in trainer.loggers:
        if logger.save_dir is not None:
            dirs[f"the {type(logger).__name__} save_dir"] = Path(logger.save_dir)
    return dirs


def check_run_dirs(trainer: pl.Trainer) -> None:
    """Each directory the run writes is a directory (or can be made one) on a writable filesystem: a
    file in its place, or a read-only directory, is named here instead of failing in a checkpoint or log write."""
    for setting, directory in run_dirs(trainer).items():
        existing = directory
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent  # the nearest part of the path that exists: where it would be made
        if not existing.is_dir():
            raise UnwritablePath(f"{setting} {directory}: {existing} is a file, not a directory; point {setting} at a directory")
        reason = unwritable_reason(existing)
        if reason:
            raise UnwritablePath(f"{setting} {directory}: cannot write in {existing} ({reason}); make it writable or point"
                                 f" {setting} elsewhere")


def unwritable_reason(directory: Path) -> str | None:
    """Why this process cannot create files in ``directory``; None when it can. ``access(2)`` also
    answers for root, who may write anywhere but on a read-only filesystem."""
    if os.access(directory, os.W_OK | os.X_OK):
        return None
    return "a read-only file system" if os.statvfs(directory).f_flag & os.ST_RDONLY else "no write permission"


MIN_FREE_TEMP_MIB = 256  # the rollout engine's copy of a small policy, and torch.compile's C++ builds (g++ writes to $TMPDIR)


def check_temp_dir() -> None:
    """``$TMPDIR`` (else the system temporary directory) is a writable directory with room: a full one
    otherwise fails deep inside torch.compile's C++ build (``g++ ... No space left on device``)."""
    path = Path(os.environ.get("TMPDIR") or tempfile.gettempdir())
    fix = "point TMPDIR at a directory on a filesystem with room"
    if not path.is_dir():
        raise UnwritablePath(f"$TMPDIR {path} is not a directory; {fix}")
    reason = unwritable_reason(path)
    if reason:
        raise UnwritablePath(f"$TMPDIR {path}: cannot write there ({reason}); {fix}")
    free = shutil.disk_usage(path).free
    if free < MIN_FREE_TEMP_MIB << 20:
        raise UnwritablePath(f"$TMPDIR {path} has {free >> 20} MiB free, less than the {MIN_FREE_TEMP_MIB} MiB a run needs"
                             f" (the rollout engine's copy of the weights, torch.compile's builds); free space there or {fix}")


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


def wasted_zero_stage(stage: int, processes: int, offload_parameters: bool) -> str | None:
    """Why a ZeRO ``stage`` buys nothing for ``processes`` training processes, or None when it may. ZeRO partitions
    state over the processes: with one there is nothing to partition, and every stage holds the same weights,
    gradients and optimizer states, while stage 3 still gathers and releases each module's parameters around its
    forward and backward. So on one process stage 3 pays only for ``offload_parameters`` (parameters in CPU memory)."""
    if processes == 1 and stage == 3 and not offload_parameters:
        return ("trainer.strategy ArcticStrategy(stage=3) on one training process partitions nothing (one rank holds every"
                " shard) but gathers and releases every module's parameters around each forward and backward; stage 1 holds"
                " the same memory without them. Use stage 3 on one process only with offload_parameters (docs/gpu.md,"
                " \"Which ZeRO stage\")")
    return None


def check_zero_stage(trainer: pl.Trainer) -> None:
    """A ZeRO stage that costs time and buys no memory (``wasted_zero_stage``): a warning, not a refusal."""
    from arctic_rl.strategies import ArcticStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, ArcticStrategy):
        return
    zero = strategy.config.get("zero_optimization", {})
    why = wasted_zero_stage(int(zero.get("stage", 0)), len(trainer.device_ids) * trainer.num_nodes, "offload_param" in zero)
    if why is not None:
        rank_zero_warn(why)


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
