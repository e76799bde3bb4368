"""``GRPOModule``: the LightningModule users subclass. Override :meth:`reward` (required) and, if
you like, :meth:`is_correct`, :meth:`compute_advantages` and :meth:`policy_loss`.

One training step = one rollout batch (``RolloutCallback`` puts a ``RolloutBatch`` in ``batch["rollout"]``):
``num_iterations`` passes over it of ``mini_batches`` optimizer steps each (manual optimization), each step
accumulated over micro-batches. Loss-side options (mismatch correction, masks) live in ``corrections.py``; the
log-prob, backward and optimizer-step operations, shared with the backend service, in ``training_core.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.advantages import group_advantages
from arctic_rl.checkpointing import enable_checkpointing
from arctic_rl.modules.corrections import (CorrectionConfig, PolicyWeights, loss_mask_of, policy_weights_of,
                                           rollout_correction_metrics)
from arctic_rl.modules.builtin_losses import fit_loss_config
from arctic_rl.modules.loss_registry import compute_loss, get_loss
from arctic_rl.modules.losses import LossConfig, LossInputs, LossNormalizer, Regularizers
from arctic_rl.liger import resolve_liger, use_liger
from arctic_rl.modules.lora import LoraOptions
from arctic_rl.modules.lr_schedule import lr_factor, schedule_length
from arctic_rl.modules.models import named_parameters_with_tied_head
from arctic_rl.modules.flat_options import OptionsView, as_hparams, nest_flat_options, section_value
from arctic_rl.modules.options import SECTIONS, ComputeOptions, OptimOptions, RefSyncOptions, RolloutOptions, SamplingOptions
from arctic_rl.modules.validation import check_settings
from arctic_rl.modules.step_metrics import accumulate, log_step
from arctic_rl.modules.token_selection import entropy_threshold, high_entropy_mask
from arctic_rl.modules.training_core import TrainingCore
from arctic_rl.modules.ref_sync import init_reference, ref_sync_callbacks
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, RolloutBatch, StepBatch
from arctic_rl.rollout.rewards import batch_normalized_advantages, check_reward_columns
from arctic_rl.strategies.zero import save_pretrained_consolidated


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, fused: bool | None = None) -> torch.optim.AdamW:
    """The policy's AdamW. ``fused=None``: torch's fused kernel (one launch over all tensors) when every parameter is
    on a GPU, else torch's default. ZeRO keeps this optimizer and steps it over its own fp32 partitions, on the
    same device, so the fused kernel runs there too (``tests/strategies/test_gpu_fused_adamw.py``)."""
    if fused is None:
        fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


class GRPOModule(TrainingCore, pl.LightningModule):
    """Group Relative Policy Optimization over a transformers causal LM.

    The options come in sections, each a dataclass documenting its fields (``options.py``); in a config,
    ``model.init_args.<section>.<field>``. The old flat keyword arguments (``temperature=...``) are still
    read, with a warning naming the new key (``flat_options.py``), and ``self.hparams.<field>`` reads a
    field by its name alone.

    Args:
        model: a ``save_pretrained`` directory (or hub id), or a config dict with ``model_type``
            for a freshly initialised model (tests, the quickstart).
        tokenizer: tokenizer directory; defaults to ``model`` when that is a path.
        dtype: parameter dtype of the policy (``float32`` on CPU; use Trainer precision for bf16).
        sampling: what the engines sample: ``group_size``, lengths, ``temperature``, ``top_p``, ``seed`` (:class:`SamplingOptions`).
        rollout: rewards to advantages: the estimator, reward weights and mix, overlong buffer, dynamic
            sampling, the reward's time limit (:class:`RolloutOptions`).
        optim: AdamW, the learning-rate schedule, gradient clipping, ``mini_batches`` and ``num_iterations`` (:class:`OptimOptions`).
        compute: micro-batches, rank balancing, gradient checkpointing, ZoRRo, Liger, the self-check;
            none changes the gradients (:class:`ComputeOptions`).
        loss: the policy objective: ``loss_type``, a registered loss's name (TRL's names and meanings for the
            built-ins, default ``dapo``; ``loss_registry.py``, plugins included), clip range,
            aggregation and the loss types' constants (:class:`~arctic_rl.modules.losses.LossConfig`).
        corrections: the sampler-mismatch correction, truncated-completion and off-policy masks, entropy
            token selection (:class:`~arctic_rl.modules.corrections.CorrectionConfig`).
        regularizers: KL penalty to a frozen reference (``kl_coef`` > 0 builds it) and entropy bonus
            (:class:`~arctic_rl.modules.losses.Regularizers`).
        ref_sync: TRL's reference-model updates (:class:`RefSyncOptions`).
        lora: LoRA adapters through peft: ``rank`` (0: off), ``alpha``, ``target_modules``; the base frozen, the
            engines given the merged weights, checkpoints holding the adapters only
            (:class:`~arctic_rl.modules.lora.LoraOptions`, ``modules/lora.py``).
        flat_options: the old flat keyword arguments, for one release.
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        tokenizer: str | None = None,
        dtype: str = "float32",
        sampling: SamplingOptions = SamplingOptions(),
        rollout: RolloutOptions = RolloutOptions(),
        optim: OptimOptions = OptimOptions(),
        compute: ComputeOptions = ComputeOptions(),
        loss: LossConfig = LossConfig(),
        corrections: CorrectionConfig = CorrectionConfig(),
        regularizers: Regularizers = Regularizers(),
        ref_sync: RefSyncOptions = RefSyncOptions(),
        lora: LoraOptions = LoraOptions(),
        **flat_options: Any,
    ) -> None:
        super().__init__()
        given, flat = locals(), nest_flat_options(flat_options)  # one warning per flat key, naming its new key
        options = {name: section_value(name, given[name], flat.get(name)) for name in SECTIONS}
        check_settings(model, tokenizer, dtype, options)  # validation.py: what no one section checks
        # save_hyperparameters reads this frame's arguments: each section as the dict checkpoints keep, flat keys folded in
        sampling, rollout, optim, compute, loss, corrections, regularizers, ref_sync, lora = map(as_hparams, options.values())
        flat_options = {}
        self._hparams = OptionsView()  # hparams.<field> reads the field in its section
        self.save_hyperparameters()
        # a subclass's __init__(**kwargs) frame gives its sections as passed: checkpoints keep plain data (a service
        # checkpoint loads with weights_only=True, which refuses dataclasses)
        self.hparams.update({key: as_hparams(value) for key, value in self.hparams.items()})
        resolve_liger(options["compute"].liger)  # liger: true without CUDA or liger-kernel is an error here, before any model
        self.loss_config, self.corrections, self.regularizers = options["loss"], options["corrections"], options["regularizers"]
        self.lora_options: LoraOptions = options["lora"]
        self.strict_loading = not self.lora_options.enabled  # a LoRA checkpoint holds the adapters only (lora.py)
        # the registered loss (loss_registry.py, plugins loaded) and the config it gets: the loss and regularizers sections
        self.loss_options = fit_loss_config(self.loss_config, self.regularizers)
        self.loss_inputs_needed = get_loss(self.loss_config.loss_type).needs_for(self.loss_options)
        self.num_iterations, self.mini_batches = options["optim"].num_iterations, options["optim"].mini_batches
        self.model_source, self.group_size = model, options["sampling"].group_size
        self.max_prompt_length, self.max_response_length = options["sampling"].max_prompt_length, options["sampling"].max_response_length
        self.micro_batch_size, self.micro_batch_tokens = options["compute"].micro_batch_size, options["compute"].micro_batch_tokens
        self.automatic_optimization = False  # several optimizer steps per rollout batch
        self._self_checked = not options["compute"].self_check  # run once, on the first training batch
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        from torchmetrics import MeanMetric

        self.epoch_reward = MeanMetric()  # per-epoch means over every sample, logged at epoch end
        self.epoch_accuracy = MeanMetric()

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
        if self.hparams.multi_objective_aggregation == "normalize_then_sum":
            return batch_normalized_advantages(rewards)
        return group_advantages(rewards, group_size, self.hparams.advantage_estimator, self.hparams.scale_rewards)

    def policy_loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch. Default: the registered loss ``loss.loss_type`` (``loss_registry.py``)
        under the ``loss`` and ``regularizers`` sections. Override it for a loss of this module only; to use a
        loss in ``fit`` and the service alike, register it instead (``register_loss``).

        Contract: ``inputs`` (:class:`~arctic_rl.modules.losses.LossInputs`) holds ``logprobs [n, R]`` (with grad),
        ``old_logprobs [n, R]``, ``advantages [n]``, ``mask [n, R]`` (:meth:`loss_mask`), ``normalizer`` (counts of
        the whole mini-batch), ``ref_logprobs [n, R]`` when ``kl_coef > 0`` or the loss needs them, ``entropy [n, R]``
        when ``entropy_coef > 0`` or the loss needs it, ``weights`` (:meth:`policy_weights`, or None) and
        ``sampler_logprobs [n, R]``. Return ``(loss, stats)``: ``loss`` a scalar tensor normalised by
        ``inputs.normalizer``, so that summing micro-batch losses gives the mini-batch loss exactly; ``stats``
        scalar tensors (per-micro-batch means), logged averaged over micro-batches.
        """
        return compute_loss(self.loss_config.loss_type, inputs, self.loss_options)

    def loss_mask(self, batch: RolloutBatch) -> torch.Tensor:
        """``[n, R]`` the tokens of ``batch`` that the loss and its normalisers count. Default: the response
        mask, less truncated completions under ``mask_truncated_completions``."""
        return loss_mask_of(self.corrections, batch)

    def policy_weights(self, batch: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor) -> PolicyWeights | None:
        """Factors on micro-batch ``batch``'s per-token policy loss (``corrections.PolicyWeights``), given its
        current ``logprobs [n, R]`` (with grad) and ``mask`` (:meth:`loss_mask`). Default: the mismatch
        correction, the off-policy sequence mask and ``batch.entropy_mask``, as configured; None: none."""
        return policy_weights_of(self.corrections, batch, logprobs, mask)

    # ------------------------------------------------------------------ model setup
    def setup(self, stage: str) -> None:
        """Check the reward's columns and the batch arithmetic against the datamodule (set up before this)
        before any model or engine starts."""
        from arctic_rl.data.prompts import PromptDataModule
        from arctic_rl.modules.lora import check_lora_strategy

        check_lora_strategy(self.lora_options, self.trainer.strategy)  # ZeRO-3 refused before any model is built
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, PromptDataModule):
            check_reward_columns(self, datamodule.columns, datamodule.train_path)
        if isinstance(datamodule, PromptDataModule) and datamodule.batch_size % self.mini_batches:
            raise ConfigError(
                f"data.batch_size={datamodule.batch_size} prompts cannot be split into model.optim.mini_batches="
                f"{self.mini_batches} equal mini-batches of whole prompt groups; make it a divisor"
            )

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from arctic_rl.patches.lightning import attached_trainer
        from arctic_rl.strategies.arctic import model_builder  # the strategy decides how models are built
        with model_builder(attached_trainer(self), self.hparams.max_grad_norm, type(self).__name__) as build:
            self.model = build(self.model_source, self.hparams.dtype)
            if self.needs_reference_model:
                self.ref_model = build(self.model_source, self.hparams.dtype)
        self.model.config.use_cache = False
        use_liger(self.hparams.liger, self.model, self.ref_model)  # in place, parameters and names unchanged
        enable_checkpointing(self.model, self.hparams.gradient_checkpointing)  # off, full or selective
        if self.ref_model is not None:
            init_reference(self.model, self.ref_model)  # a frozen copy of the policy (ZeRO-3: gathered pairwise)
        if self.lora_options.enabled:  # after the reference copy: the initial policy is the base model
            from arctic_rl.modules.lora import apply_lora

            apply_lora(self.model, self.lora_options)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = adamw([p for p in self.model.parameters() if p.requires_grad], hp.learning_rate, hp.weight_decay)
        total = self.schedule_steps()
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, hp.warmup_steps, total, hp.lr_schedule, hp.min_lr_ratio, hp.num_cycles)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @property
    def vocab_size(self) -> int:
        """The policy model's vocabulary size (its embedding rows; the engines run the same model): token ids are
        ``0 <= id < vocab_size``. Read once the model is built (``configure_model``)."""
        return self.model.config.get_text_config().vocab_size

    @property
    def needs_reference_model(self) -> bool:
        """Whether ``configure_model`` builds a frozen reference copy of the initial policy (KL penalty, or a
        registered loss that needs ``ref_logprobs``)."""
        return self.hparams.kl_coef > 0 or "ref_logprobs" in self.loss_inputs_needed

    def schedule_steps(self) -> int:
        """The learning-rate schedule's length in optimizer steps (``lr_schedule.schedule_length``)."""
        return schedule_length(self.trainer, self.hparams.lr_schedule, self.mini_batches * self.num_iterations)

    def configure_callbacks(self) -> list[pl.Callback]:
        """Adds a default :class:`RolloutCallback` when the trainer has none, and the run's safety net
        (``callbacks/safety_net.py``: summary, atomic checkpoints, exact resume, SIGTERM)."""
        from arctic_rl.callbacks.safety_net import safety_net_callbacks
        from arctic_rl.rollout.callback import RolloutCallback

        extra: list[pl.Callback] = ref_sync_callbacks(self.hparams) + safety_net_callbacks()  # sync before checkpoints
        if not any(isinstance(cb, RolloutCallback) for cb in self.trainer.callbacks):
            extra.append(RolloutCallback())
        return extra

    def named_parameters_for_sync(self, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every policy parameter, as the rollout engine loads them.

        A tied output embedding is yielded under its own name too, right after the embedding: vLLM's
        in-place reload does not re-tie ``lm_head`` to ``embed_tokens`` and would keep sampling with the
        old head. Under ZeRO-3 the parameters are all-gathered ``bucket_bytes`` at a time (extra memory:
        one bucket, never the model); that is a collective, so every rank must exhaust the iterator, and a
        yielded tensor is valid only until the next is requested (clone it to keep it)."""
        from arctic_rl.strategies.zero import gather_in_buckets

        named = gather_in_buckets(named_parameters_with_tied_head(self.model), bucket_bytes)
        if self.lora_options.enabled:  # the engines load the base model's names: the adapters merged in
            from arctic_rl.modules.lora import merged_named_tensors

            named = merged_named_tensors(self.model, named)
        yield from named

    def save_policy(self, directory: str | None, bucket_bytes: int = 256 << 20) -> None:
        """Write the current policy and tokenizer as a ``save_pretrained`` directory.

        Under ZeRO-3 the weights are consolidated into CPU memory a bucket of ``bucket_bytes`` at a time:
        every rank must call this (a collective) and every caller writes ``directory``; a rank that passes
        None takes part in the collective and writes nothing."""
        if self.lora_options.enabled:  # the merged weights under the base model's names, as the engines load them
            if directory is None:  # LoRA runs under ZeRO 0-2 only: every rank holds the weights, nothing to take part in
                return None
            from arctic_rl.modules.lora import save_merged

            return save_merged(self.model, self.tokenizer, directory, self.named_parameters_for_sync(bucket_bytes))
        save_pretrained_consolidated(self.model, self.tokenizer, directory, bucket_bytes)

    @property
    def checkpoint_trainable_only(self) -> bool:
        """LoRA: checkpoints hold the trainable weights (the adapters) only; ArcticStrategy reads this too."""
        return self.lora_options.enabled

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """LoRA: the checkpoint keeps the adapters only (the base is rebuilt from ``model.model``)."""
        if self.lora_options.enabled and "state_dict" in checkpoint:
            from arctic_rl.modules.lora import adapter_only

            checkpoint["state_dict"] = adapter_only(checkpoint["state_dict"])

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """LoRA: the checkpoint must hold exactly this model's adapters (it is loaded non-strictly); without LoRA,
        no adapters."""
        from arctic_rl.modules.lora import adapter_only, check_adapter_checkpoint

        if self.lora_options.enabled and "state_dict" in checkpoint:
            check_adapter_checkpoint(checkpoint["state_dict"], adapter_only(self.state_dict()))
        elif adapter_only(checkpoint.get("state_dict", {})):
            raise ConfigError("the checkpoint holds LoRA adapters only, and this model has no LoRA (model.lora.rank 0):"
                              " set model.lora as the checkpoint was trained to resume it")

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
            if self.micro_batch_tokens is not None and world_size > 1 and self.hparams.balance_ranks:
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

    def check_first_batch(self, rollout: RolloutBatch) -> dict[str, float]:
        """The start-up self-check (``self_check.py``) on ``rollout`` if it has not run yet (and ``self_check``
        is on); call it inside the training step's forward context (ZeRO-3 gathers as in training). Returns its
        metrics, or {} when it does not run. Raises ``SelfCheckFailed``."""
        if self._self_checked:
            return {}
        from arctic_rl.modules.self_check import check_first_batch as self_check

        hp, self._self_checked = self.hparams, True
        return self_check(self.model, rollout, hp.zorro, hp.attention_backend, hp.temperature,
                          self.tokenizer.pad_token_id, hp.zorro_dedup).as_metrics()
