"""``MidEpochStop``: a checkpoint written after a run stopped mid-epoch resumes mid-epoch.

When a run stops before its epoch's data is exhausted (``max_steps``, ``max_time``, SIGTERM, any
``trainer.should_stop``), Lightning still runs its epoch-end accounting and counts the epoch as
finished. A checkpoint written after that (ModelCheckpoint's end-of-run ``last.ckpt``, the SIGTERM
checkpoint) would resume at the start of the *next* epoch, and the rest of this epoch's prompts would
never be seen. This callback rewrites the loop state of such a checkpoint into exactly the state a
checkpoint written at the last batch's ``on_train_batch_end`` has, so a resume continues with the
next batch of the same epoch, with the same epoch number, step for step like an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


def stopped_mid_epoch(trainer: pl.Trainer) -> bool:
    """True after the epoch-end accounting of an epoch whose data was not exhausted."""
    epochs = trainer.fit_loop.epoch_progress.current
    batches = trainer.fit_loop.epoch_loop.batch_progress
    return epochs.processed == epochs.started > 0 and batches.current.processed > 0 and not batches.is_last_batch


def _step_back(progress: dict[str, dict[str, int]], *fields: str) -> None:
    for counters in (progress["total"], progress["current"]):
        for field in fields:
            counters[field] -= 1


class MidEpochStop(pl.Callback):
    """Saves a stopped-mid-epoch position as mid-epoch (see the module docstring)."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        if not trainer.training or not stopped_mid_epoch(trainer):
            return
        loop = checkpoint["loops"]["fit_loop"]
        epochs = loop["epoch_progress"]
        _step_back(epochs, "processed")
        if epochs["current"]["completed"] > epochs["current"]["processed"]:  # after on_train_epoch_end
            _step_back(epochs, "completed")
        _step_back(loop["epoch_loop.batch_progress"], "completed")  # "saved at on_train_batch_end"
        loop["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1  # Lightning adds it back on restart
        checkpoint["epoch"] = epochs["current"]["processed"]
