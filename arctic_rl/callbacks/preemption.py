"""``StopOnSigterm``: SIGTERM (preemption, ``docker stop``, Slurm) ends a run cleanly and resumably.

On the first SIGTERM the step in flight (rollout, optimizer steps, weight sync) finishes; then
``last.ckpt`` is written in the checkpoint directory (atomically; it resumes mid-epoch exactly, see
``resume_state``), training stops, the summary is printed, the rollout engines and Ray actors are
shut down as at any end of ``fit``, and ``arctic-rl`` exits with :data:`SIGTERM_EXIT_CODE`. A second
SIGTERM abandons the step at once (engines still shut down; no new checkpoint).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

# 128 + 15: what a shell reports for a process ended by SIGTERM; distinct from 1 (a crash), so a job
# script can requeue on it.
SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


class StopOnSigterm(pl.Callback):
    """Turns SIGTERM into: finish the step, save ``last.ckpt``, stop (see the module docstring)."""

    def __init__(self) -> None:
        self.received = False  # a SIGTERM arrived during this fit
        self.checkpoint: Path | None = None  # what was saved because of it
        self._previous_handler = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.received, self.checkpoint = False, None
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.received:
            raise SystemExit(SIGTERM_EXIT_CODE)  # the second one: abandon the step
        self.received = True
        print("arctic-rl: SIGTERM received: finishing the current step, then saving a checkpoint and stopping"
              " (a second SIGTERM stops at once, without one)", file=sys.stderr, flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        stop = trainer.strategy.reduce_boolean_decision(self.received, all=False) if trainer.world_size > 1 else self.received
        if not stop:
            return
        self.received = True  # on every rank: one of them was signalled
        self.checkpoint = last_checkpoint_path(trainer)
        trainer.save_checkpoint(self.checkpoint)
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.save_last:
                callback.last_model_path = str(self.checkpoint)  # it overwrites this one at train end, not a last-v1
        trainer.should_stop = True

    def on_train_end(self, trainer: pl.Trainer, pl_module) -> None:
        self._restore_handler()
        if self.received and trainer.is_global_zero:
            print(f"arctic-rl: stopped by SIGTERM after step {trainer.global_step}; resume with --ckpt_path"
                  f" {self.checkpoint} (exit code {SIGTERM_EXIT_CODE})", flush=True)

    def on_exception(self, trainer: pl.Trainer, pl_module, exception: BaseException) -> None:
        self._restore_handler()

    def _restore_handler(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None


def last_checkpoint_path(trainer: pl.Trainer) -> Path:
    """``last.ckpt`` in the first ModelCheckpoint's directory, else in ``<default_root_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.dirpath:
        return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"


def exit_code(trainer: pl.Trainer) -> int:
    """:data:`SIGTERM_EXIT_CODE` when a SIGTERM stopped the trainer's last fit, else 0."""
    stopped = any(isinstance(cb, StopOnSigterm) and cb.received for cb in trainer.callbacks)
    return SIGTERM_EXIT_CODE if stopped else 0
