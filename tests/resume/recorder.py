"""Test callbacks used from run configs (``class_path: tests.resume.recorder.X``) in CLI subprocesses."""

from __future__ import annotations

import json
import os
import signal

import lightning.pytorch as pl

from arctic_rl.data.prompts import PROMPT


class RecordSteps(pl.Callback):
    """Appends one JSON line per rollout batch to ``path``: step, epoch, prompts, reward, lr."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        row = {"step": trainer.global_step - 1, "epoch": trainer.current_epoch, "prompts": list(batch[PROMPT]),
               "reward": float(batch["rollout_metrics"]["reward/mean"]), "lr": pl_module.lr_schedulers().get_last_lr()[0]}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


class RecordStreamGroups(pl.Callback):
    """Appends one JSON line per rollout batch to ``path``: the step and the rollout stream's groups it trained on."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "groups": list(batch["stream_groups"])}) + "\n")


class SigtermAtStep(pl.Callback):
    """Sends this process a real SIGTERM as step ``step`` starts (before its rollout)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def read_steps(path) -> dict[int, dict]:
    with open(path) as f:
        return {row["step"]: row for row in map(json.loads, f)}
