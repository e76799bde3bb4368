"""A test callback for ``arctic-rl fit`` runs (``class_path: tests.serve.fit_recorder.RecordTraining``): what a
client loop needs to replay the run (each step's prompts, answers and completions) and what it must match
(each step's loss and gradient norm, the final weights)."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import torch

from arctic_rl.data.prompts import PROMPT_IDS


class RecordTraining(pl.Callback):
    def __init__(self, path: str, weights_path: str) -> None:
        self.path, self.weights_path = path, weights_path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        rollout, metrics = batch["rollout"], trainer.callback_metrics
        row = {"step": trainer.global_step - 1, "prompt_ids": batch[PROMPT_IDS], "answer": list(batch["answer"]),
               "completions": rollout.completions, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_end(self, trainer, pl_module):
        torch.save({k: v.detach().cpu() for k, v in pl_module.model.state_dict().items()}, self.weights_path)
