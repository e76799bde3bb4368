"""Reference-model updates (TRL's ``sync_ref_model``, from TR-DPO, Gorbatovski et al. 2024, arXiv
2404.09656): after every ``ref_model_sync_steps``-th optimizer step the KL reference becomes
``alpha * policy + (1 - alpha) * reference`` (``ref_model_mixup_alpha``).

TRL mixes after the optimizer step whose number is a multiple of ``ref_model_sync_steps``; with
several optimizer steps per rollout batch (``mini_batches``) that step may fall inside a training step,
so :class:`RefModelSync` mixes there too (before the next optimizer step) and otherwise at the end of
the rollout batch, before any checkpoint of that step is written. A rollout batch's reference
log-probs are computed once, before its first optimizer step (as in TRL). The reference model is part
of the module, so checkpoints keep the mixed weights (under DeepSpeed ZeRO-2/3 as frozen parameters)
and a resumed run continues with them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from arctic_rl.strategies.zero import copy_parameters, is_partitioned


def init_reference(policy: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Make ``reference`` a frozen copy of ``policy`` (same start, also for a random init)."""
    copy_parameters(policy, reference)
    reference.requires_grad_(False).eval()


def ref_sync_callbacks(options) -> list[pl.Callback]:
    """``[RefModelSync]`` when ``options.sync_ref_model`` (the ``ref_sync`` section) is set, else ``[]`` (its settings are checked where they
    live: ``options.RefSyncOptions`` and, with the KL weight, ``validation.check_settings``)."""
    if not options.sync_ref_model:
        return []
    return [RefModelSync(options.ref_model_mixup_alpha, options.ref_model_sync_steps)]


@torch.no_grad()
def mix_parameters(source: torch.nn.Module, target: torch.nn.Module, alpha: float) -> None:
    """``target := alpha * source + (1 - alpha) * target``, parameter by parameter (same architecture).
    Under ZeRO-3 each pair is gathered, mixed on rank 0 and re-partitioned: one pair of full parameters
    at a time, never a whole model; a collective, so every rank calls it."""
    pairs = list(zip(source.parameters(), target.parameters(), strict=True))
    if not any(is_partitioned(s) or is_partitioned(t) for s, t in pairs):
        for s, t in pairs:
            t.mul_(1.0 - alpha).add_(s.to(t.dtype), alpha=alpha)
        return
    import deepspeed

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for s, t in pairs:
        with deepspeed.zero.GatheredParameters([s, t], modifier_rank=0):  # rank 0 writes; scattered on exit
            if rank == 0:
                t.data.mul_(1.0 - alpha).add_(s.data.to(t.dtype), alpha=alpha)


class RefModelSync(pl.Callback):
    """Mixes the policy into ``pl_module.ref_model`` after every ``every``-th optimizer step (see the
    module docstring); ``GRPOModule.configure_callbacks`` adds it when ``sync_ref_model`` is set."""

    def __init__(self, alpha: float, every: int) -> None:
        self.alpha, self.every = alpha, every
        self._batch_first_step = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch, batch_idx: int) -> None:
        self._batch_first_step = trainer.global_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module, optimizer) -> None:
        done = trainer.global_step  # optimizer steps completed; a batch's first step was handled at the last batch end
        if done > self._batch_first_step and done % self.every == 0:
            mix_parameters(pl_module.model, pl_module.ref_model, self.alpha)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every == 0:
            mix_parameters(pl_module.model, pl_module.ref_model, self.alpha)
