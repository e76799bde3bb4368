"""The progress bar ``arctic-rl fit`` adds: Lightning's Rich bar, minus a misleading epoch total.

GRPO runs are bounded by ``max_steps`` and the CLI sets ``max_epochs: -1``; Lightning's
``RichProgressBar`` then titles the bar ``Epoch 6/-2`` (it prints ``max_epochs - 1``). This one
prints ``Epoch 6`` when there is no epoch limit and is otherwise the same bar.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            description = description.replace(f"/{max_epochs - 1}", "", 1)
        return description
