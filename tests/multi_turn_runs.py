"""Training a multi-turn toy in this process and recording its per-step success (the learning tests of the tool
toy and the search toy)."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl

from arctic_rl.cli import build_cli
from tests.helpers import quickstart_config, write_config


class RecordAccuracy(pl.Callback):
    """Each step's ``accuracy`` and mean turns per episode, from the rollout's metrics."""

    def __init__(self) -> None:
        self.accuracy: list[float] = []
        self.turns: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = batch["rollout_metrics"]
        self.accuracy.append(metrics["accuracy"])
        self.turns.append(metrics["multi_turn/turns_mean"])


def train_and_record(task: Path, run_root: Path, source: str, steps: int) -> RecordAccuracy:
    """Fit ``source`` (a config of the repository) on ``task`` for ``steps`` steps; the recorded metrics."""
    config = quickstart_config(task, run_root / "run", source=source,
                               **{"trainer.max_steps": steps, "trainer.enable_progress_bar": False})
    cli = build_cli(["--config", str(write_config(config, run_root / "config.yaml"))], run=False)
    record = RecordAccuracy()
    cli.trainer.callbacks.append(record)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return record
