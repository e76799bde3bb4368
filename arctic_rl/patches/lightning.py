"""The one place that touches Lightning's private (``_``-prefixed) internals, as named functions; checked by
``scripts/check_structure.py``, which refuses them anywhere else. Each function says what it stands in for and
which Lightning version it was written against (lightning 2.6.6); if an upgrade breaks one, it breaks here.

Overriding one of Lightning's hooks in a subclass (``ArcticStrategy._setup_model_and_optimizer``) is the
subclass's own business and stays with it; reading or calling Lightning's private state goes through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning.fabric.utilities.types import _PATH

if TYPE_CHECKING:
    import lightning.pytorch as pl

PathLike = _PATH  # Lightning's ``str | Path`` alias, the type its strategies' checkpoint methods are declared with


def rich_available() -> bool:
    """Whether Lightning sees the ``rich`` package (``lightning.pytorch.utilities.imports._RICH_AVAILABLE``),
    i.e. whether it would pick its Rich progress bar by default."""
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return bool(_RICH_AVAILABLE)


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """``module``'s Trainer, or None when it is not attached to one (``LightningModule.trainer`` raises
    then; its ``_trainer`` is the attribute behind it)."""
    return module._trainer


def init_deepspeed_distributed(strategy: Any) -> None:
    """``DeepSpeedStrategy._init_deepspeed_distributed()``: DeepSpeed's process group (the last part of its
    ``setup_distributed``, which ``ArcticStrategy`` runs without the CUDA-only device-index check)."""
    strategy._init_deepspeed_distributed()


def restore_checkpoint(trainer: pl.Trainer, checkpoint: Path) -> int:
    """Restore the model, optimizers and LR schedulers of a running, manually optimized fit from
    ``checkpoint`` (loaded with ``weights_only=True``), as ``--ckpt_path`` restores them at the start of a
    fit (the trainer's ``_checkpoint_connector``), and set ``trainer.global_step`` (the fit loop's manual
    optimization step counter) to the checkpoint's. Returns that step."""
    connector = trainer._checkpoint_connector
    connector.resume_start(checkpoint, weights_only=True)
    connector.restore_model()
    connector.restore_optimizers_and_schedulers()
    step = int(connector._loaded_checkpoint["global_step"])
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total
    progress.ready = progress.completed = step  # trainer.global_step
    connector.resume_end()
    return step
