"""``GRPOModule``: the LightningModule users subclass. Override :meth:`reward` (required) and, if
you like, :meth:`is_correct`, :meth:`compute_advantages` and :meth:`policy_loss`.

One training step = one rollout batch (``RolloutCallback`` puts a ``RolloutBatch`` in ``batch["rollout"]``):
``num_iterations`` passes over it of ``mini_batches`` optimizer steps each (manual optimization), each step
accumulated over micro-batches. The policy itself (options, model, optimizer, loss hooks, weight export) is
``PolicyModule`` (``policy_module.py``), shared with the backend service; loss-side options (mismatch correction,
masks) live in ``corrections.py``; the log-prob, backward and optimizer-step operations in ``training_core.py``.
"""

from __future__ import annotations

import time
from dataclasses import replace

import lightning.pytorch as pl
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.advantages import group_advantages
from arctic_rl.modules.corrections import rollout_correction_metrics
from arctic_rl.modules.losses import LossNormalizer
from arctic_rl.modules.policy_module import PolicyModule, adamw
from arctic_rl.modules.step_metrics import accumulate, log_step
from arctic_rl.modules.token_selection import entropy_threshold, high_entropy_mask
from arctic_rl.modules.ref_sync import ref_sync_callbacks
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, RolloutBatch, StepBatch
from arctic_rl.rollout.rewards import batch_normalized_advantages, check_reward_columns

__all__ = ["GRPOModule", "adamw"]


class GRPOModule(PolicyModule):
    """Group Relative Policy Optimization over a transformers causal LM: a :class:`PolicyModule` (its options
    and their sections are documented there, ``model.init_args.<section>.<field>`` in a config) whose training
    step is one rollout batch, with the user's reward and advantage hooks.
    """

    # ------------------------------------------------------------------ user hooks
    def reward(self, prompts: list[str], completions: list[str], **columns: list) -> list[float]:
        """Score each completion. Called once per rollout batch with ``N = prompts x G`` entries.

        Args:
            prompts: the prompt of each completion (repeated G times, in order).
            completions: decoded completions, special tokens removed.
            columns: the prompt dataset's other columns, repeated like ``prompts`` (e.g. ``answer``).

        Returns:
            ``N`` finite floats. Raising, returning the wrong length or a NaN stops training with
            an error naming the sample.
        """
        raise NotImplementedError(f"{type(self).__name__} must override reward(prompts, completions, **columns)")

    reward.placeholder_reward = True  # multi-turn: a module that does not override reward is scored by its environment alone

    def is_correct(self, prompts: list[str], completions: list[str], **columns: list) -> list[bool] | None:
        """Optional task accuracy: one bool per completion, logged as ``accuracy``. ``None``: no metric."""
        return None

    def compute_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """Map rewards ``[N]`` (groups of ``group_size`` contiguous) to one advantage per sequence ``[N]``.
        Default: ``advantage_estimator`` within each group, scaled per ``scale_rewards`` (``normalize_then_sum``: TRL's)."""
        if self.options.rollout.multi_objective_aggregation == "normalize_then_sum":
            return batch_normalized_advantages(rewards)
        return group_advantages(rewards, group_size, self.options.rollout.advantage_estimator, self.options.rollout.scale_rewards)

    # ------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        """Check the reward's columns and the batch arithmetic against the datamodule (set up before this)
        before any model or engine starts."""
        from arctic_rl.data.prompts import PromptDataModule
        from arctic_rl.modules.lora import check_lora_strategy

        check_lora_strategy(self.lora_options, self.trainer.strategy)  # ZeRO-3 refused before any model is built
        self.sequence_parallel  # compute.sequence_parallel: checked against the world and its groups built, on every rank
        if self.group_size is None:  # only a front door whose requests bring their own groups leaves it out
            raise ConfigError("model.sampling.group_size must be >= 2 (GRPO compares samples within a group), got None")
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, PromptDataModule):
            check_reward_columns(self, datamodule.columns, datamodule.train_path)
        if isinstance(datamodule, PromptDataModule) and datamodule.batch_size % self.mini_batches:
            raise ConfigError(
                f"data.batch_size={datamodule.batch_size} prompts cannot be split into model.optim.mini_batches="
                f"{self.mini_batches} equal mini-batches of whole prompt groups; make it a divisor"
            )

    def configure_callbacks(self) -> list[pl.Callback]:
        """Adds a default :class:`RolloutCallback` when the trainer has none, and the run's safety net
        (``callbacks/safety_net.py``: summary, atomic checkpoints, exact resume, SIGTERM)."""
        from arctic_rl.callbacks.safety_net import safety_net_callbacks
        from arctic_rl.rollout.callback import RolloutCallback

        extra: list[pl.Callback] = ref_sync_callbacks(self.options.ref_sync) + safety_net_callbacks()  # sync before checkpoints
        if not any(isinstance(cb, RolloutCallback) for cb in self.trainer.callbacks):
            extra.append(RolloutCallback())
        return extra

    # ------------------------------------------------------------------ training
    def _balance_across_ranks(self, mini: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """This rank's share of every rank's ``mini`` re-dealt by token load (``rank_balance.py``), and
        the imbalance metrics; its own ``mini`` where the deal is not better."""
        from arctic_rl.modules.rank_balance import balance_across_ranks

        return balance_across_ranks(mini, self.trainer.world_size, self.trainer.global_rank, self.micro_batch_tokens)

    def _fill_reference_logprobs(self, rollout: RolloutBatch) -> None:
        off_policy = self.mini_batches * self.num_iterations > 1  # later optimizer steps are off-policy
        wanted = off_policy or self.corrections.vllm_importance_sampling_correction
        if wanted and rollout.old_logprobs is None:  # already set: a stale (overlapped) batch, the sampler's
            rollout.old_logprobs = self.batch_logprobs(self.model, rollout)[0]
        if self.ref_model is not None:
            rollout.ref_logprobs = self.batch_logprobs(self.ref_model, rollout)[0]

    def _select_tokens(self, mini: RolloutBatch, normalizer: LossNormalizer) -> tuple[RolloutBatch, LossNormalizer]:
        """``top_entropy_quantile``: ``mini`` with its ``entropy_mask`` (the current policy's entropies, the
        threshold over every rank's mini-batch) and the normaliser with the selected-token count."""
        if self.corrections.top_entropy_quantile >= 1.0:
            return mini, normalizer
        mask, all_ranks = self.loss_mask(mini), self.trainer.world_size > 1
        entropy = self.batch_logprobs(self.model, mini, with_entropy=True)[1]
        selected = high_entropy_mask(entropy, mask, entropy_threshold(entropy, mask, self.corrections.top_entropy_quantile, all_ranks))
        count = LossNormalizer.of(selected, self.max_response_length, all_ranks=all_ranks).num_tokens
        return replace(mini, entropy_mask=selected), replace(normalizer, num_selected_tokens=count)

    def training_step(self, batch: StepBatch, batch_idx: int) -> torch.Tensor:
        """One rollout batch (``batch["rollout"]``): reference log-probs, then ``num_iterations`` x ``mini_batches``
        optimizer steps, each :meth:`backward_batch` then :meth:`apply_gradients`. Returns the mean loss; logs
        ``skipped_nonfinite_steps``, this batch's steps skipped for a non-finite gradient."""
        rollout: RolloutBatch = batch[ROLLOUT].to(self.device)
        sums: dict[str, float] = self.check_first_batch(rollout)
        started = time.perf_counter()
        self._fill_reference_logprobs(rollout)
        sums.update(rollout_correction_metrics(self.corrections, rollout))
        optimizer = self.optimizers()
        weight = 1.0 / (self.mini_batches * self.num_iterations)
        for mini in rollout.split(self.mini_batches) * self.num_iterations:  # the old policy stays the sampling-time one
            world_size = self.trainer.world_size  # the normaliser counts every rank's mini-batch
            normalizer = LossNormalizer.of(self.loss_mask(mini), self.max_response_length, all_ranks=world_size > 1)
            mini, normalizer = self._select_tokens(mini, normalizer)
            if self.micro_batch_tokens is not None and world_size > 1 and self.options.compute.balance_ranks:
                mini, loads = self._balance_across_ranks(mini)
                accumulate(sums, loads, weight)
            optimizer.zero_grad()
            mini_loss, stats = self.backward_batch(mini, normalizer)
            accumulate(sums, stats, weight)
            grad_norm, _, skipped = self.apply_gradients()  # a non-finite gradient's step is skipped, and counted
            accumulate(sums, {"loss": mini_loss, "grad_norm": grad_norm}, weight)
            accumulate(sums, {"skipped_nonfinite_steps": float(skipped)}, 1.0)
        train_s = time.perf_counter() - started
        log_step(self, rollout, batch[ROLLOUT_METRICS], sums, train_s)
        return torch.tensor(sums["loss"])

