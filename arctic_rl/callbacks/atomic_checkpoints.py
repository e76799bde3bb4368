"""Single-file checkpoints published atomically on the checkpoint's own filesystem.

Lightning's default ``TorchCheckpointIO`` writes through an fsspec transaction whose temp file lives
in ``TMPDIR``; when that is another filesystem than the checkpoint directory (tmpfs ``/tmp``, NFS),
the final rename fails with EXDEV and the fallback copy truncates the destination first, so a kill
or a full disk during the copy leaves ``last.ckpt`` empty or truncated. :class:`AtomicCheckpointIO`
writes into a hidden temp file in the checkpoint's own directory (``.last.ckpt.tmp-3f9a1c07``),
flushes it to disk, and swaps it in with one ``os.replace`` (atomic within a filesystem). A write
that fails for any reason (disk full, a signal, a crash) removes its temp file and leaves the
previous checkpoint as it was. DeepSpeed checkpoints (directories) are published the same way by
``arctic_rl.strategies.checkpoint``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins import TorchCheckpointIO
from typing_extensions import override

from arctic_rl.errors import DISK_FULL, os_error_in, unwritable

TEMP_MARK = ".tmp-"  # temp files are ``.<name>.tmp-<8 hex>``: hidden, and never ending in ``.ckpt``


def write_atomically(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Create or replace ``path`` with what ``write(file)`` writes, all or nothing. A full disk is an
    :class:`~arctic_rl.errors.UnwritablePath` naming ``path`` (one line from ``arctic-rl``)."""
    path = Path(path)
    temp = path.with_name(f".{path.name}{TEMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)  # same directory, so same filesystem: atomic
    except BaseException as e:
        temp.unlink(missing_ok=True)
        error = os_error_in(e)
        if error is not None and error.errno in DISK_FULL:  # torch.save reports it as "unexpected pos", naming no path
            raise unwritable(path, error, f"free space in {path.parent} (the previous checkpoint there is intact)") from e
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves go through :func:`write_atomically` (remote URLs: as Lightning)."""

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda f: torch.save(checkpoint, f))


class AtomicCheckpoints(pl.Callback):
    """Gives the trainer's strategy :class:`AtomicCheckpointIO` where it would use Lightning's plain
    ``TorchCheckpointIO`` (the default, single-device and DDP strategies); a checkpoint IO of the
    user's own is kept as it is."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
