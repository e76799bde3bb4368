"""After a resume, the restored optimizer follows the config's learning rate and weight decay (what
``resume_policy.py`` announces as applied)."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.optim.lr_scheduler import LambdaLR


class OptimizerFollowsConfig(pl.Callback):
    """After a resume, sets the restored optimizer's and LR scheduler's base learning rate and weight
    decay to the config's (a checkpoint's optimizer state carries the values it was trained with)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path is None:
            return
        lr, weight_decay = pl_module.options.optim.learning_rate, pl_module.options.optim.weight_decay
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["initial_lr"], group["weight_decay"] = lr, weight_decay
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if not isinstance(scheduler, LambdaLR):  # GRPOModule's; a user's own scheduler is left alone
                continue
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
            for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
                group["lr"] = lr * factor(scheduler.last_epoch)
