"""``PolicyModule``: the policy a training job holds, as a LightningModule: its options, tokenizer, model (and frozen
reference), optimizer and schedule, loss hooks, checkpoint hooks (LoRA), and the two ways its weights leave it (a
``save_pretrained`` directory, a stream of named tensors for the engines). ``GRPOModule`` (``arctic-rl fit``) and the
backend service's module are each a ``PolicyModule`` with their own training loop on top."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.checkpointing import enable_checkpointing
from arctic_rl.router_replay import install_router_hooks
from arctic_rl.modules.corrections import PolicyWeights, loss_mask_of, policy_weights_of
from arctic_rl.modules.builtin_losses import fit_loss_config
from arctic_rl.loss_registry import compute_loss, get_loss
from arctic_rl.modules.losses import LossInputs
from arctic_rl.liger import resolve_liger, use_liger
from arctic_rl.modules.lr_schedule import lr_factor, schedule_length
from arctic_rl.modules.models import named_parameters_with_tied_head
from arctic_rl.modules.flat_options import nest_flat_options, section_value
from arctic_rl.options import (ComputeOptions, CorrectionConfig, LoraOptions, LossConfig, ModuleOptions, OptimOptions,
                               RefSyncOptions, Regularizers, RolloutOptions, SamplingOptions)
from arctic_rl.modules.validation import check_settings
from arctic_rl.modules.training_core import TrainingCore
from arctic_rl.modules.ref_sync import init_reference
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.strategies.zero import save_pretrained_consolidated


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float, fused: bool | None = None) -> torch.optim.AdamW:
    """The policy's AdamW. ``fused=None``: torch's fused kernel (one launch over all tensors) when every parameter is
    on a GPU, else torch's default. ZeRO keeps this optimizer and steps it over its own fp32 partitions, on the
    same device, so the fused kernel runs there too (``tests/strategies/test_gpu_fused_adamw.py``)."""
    if fused is None:
        fused = True if params and all(p.is_cuda for p in params) else None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


class PolicyModule(TrainingCore, pl.LightningModule):
    """A causal-LM policy with its options, optimizer, loss and weight export; no training loop of its own.

    The options come in sections, each a dataclass documenting its fields (the ``arctic_rl.options`` package); in a config,
    ``model.init_args.<section>.<field>``; in code, ``self.options.<section>.<field>`` (a frozen
    :class:`~arctic_rl.options.ModuleOptions`). The old flat keyword arguments (``temperature=...``) are
    still read, with a warning naming the new key (``flat_options.py``). ``hparams`` is what checkpoints keep.

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
            aggregation and the loss types' constants (:class:`~arctic_rl.options.LossConfig`).
        corrections: the sampler-mismatch correction, truncated-completion and off-policy masks, entropy
            token selection (:class:`~arctic_rl.options.CorrectionConfig`).
        regularizers: KL penalty to a frozen reference (``kl_coef`` > 0 builds it) and entropy bonus
            (:class:`~arctic_rl.options.Regularizers`).
        ref_sync: TRL's reference-model updates (:class:`RefSyncOptions`).
        lora: LoRA adapters through peft: ``rank`` (0: off), ``alpha``, ``target_modules``; the base frozen, the
            engines given the merged weights, checkpoints holding the adapters only
            (:class:`~arctic_rl.options.LoraOptions`, ``modules/lora.py``).
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
        flat = nest_flat_options(flat_options)  # one warning per flat key, naming its new key
        given = {"sampling": sampling, "rollout": rollout, "optim": optim, "compute": compute, "loss": loss,
                 "corrections": corrections, "regularizers": regularizers, "ref_sync": ref_sync, "lora": lora}
        self.options = ModuleOptions(**{name: section_value(name, value, flat.get(name)) for name, value in given.items()})
        check_settings(model, tokenizer, dtype, self.options)  # validation.py: what no one section checks
        # checkpoints keep plain data (a service checkpoint loads with weights_only=True, which refuses dataclasses):
        # the constructor's arguments (a subclass's too) with each section as the dict of its fields, flat keys folded in:
        # save_hyperparameters reads this frame's arguments, where the flat keys (and the CLI's bookkeeping that
        # load_from_checkpoint passes back) are emptied
        flat_options = {}  # noqa: F841
        self.save_hyperparameters()
        self.hparams.update(self.options.as_dict())
        self.model_dtype = dtype
        resolve_liger(self.options.compute.liger)  # liger: true without CUDA or liger-kernel is an error here, before any model
        self.loss_config, self.corrections, self.regularizers = self.options.loss, self.options.corrections, self.options.regularizers
        self.lora_options: LoraOptions = self.options.lora
        self.strict_loading = not self.lora_options.enabled  # a LoRA checkpoint holds the adapters only (lora.py)
        # the registered loss (loss_registry.py, plugins loaded) and the config it gets: the loss and regularizers sections
        self.loss_options = fit_loss_config(self.loss_config, self.regularizers)
        self.loss_inputs_needed = get_loss(self.loss_config.loss_type).needs_for(self.loss_options)
        self.num_iterations, self.mini_batches = self.options.optim.num_iterations, self.options.optim.mini_batches
        self.model_source, self.group_size = model, self.options.sampling.group_size
        self.max_prompt_length, self.max_response_length = self.options.sampling.max_prompt_length, self.options.sampling.max_response_length
        self.micro_batch_size, self.micro_batch_tokens = self.options.compute.micro_batch_size, self.options.compute.micro_batch_tokens
        self.automatic_optimization = False  # several optimizer steps per rollout batch
        self._self_checked = not self.options.compute.self_check  # run once, on the first training batch
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        from torchmetrics import MeanMetric

        self.epoch_reward = MeanMetric()  # per-epoch means over every sample, logged at epoch end
        self.epoch_accuracy = MeanMetric()

    # ------------------------------------------------------------------ loss hooks
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
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from arctic_rl.patches.lightning import attached_trainer
        from arctic_rl.strategies.arctic import model_builder  # the strategy decides how models are built
        with model_builder(attached_trainer(self), self.options.optim.max_grad_norm, type(self).__name__) as build:
            self.model = build(self.model_source, self.model_dtype)
            if self.needs_reference_model:
                self.ref_model = build(self.model_source, self.model_dtype)
        self.model.config.use_cache = False
        use_liger(self.options.compute.liger, self.model, self.ref_model)  # in place, parameters and names unchanged
        enable_checkpointing(self.model, self.options.compute.gradient_checkpointing)  # off, full or selective
        if self.options.corrections.router_replay:  # the policy's forwards route to the sampler's experts
            install_router_hooks(self.model)
        if self.ref_model is not None:
            init_reference(self.model, self.ref_model)  # a frozen copy of the policy (ZeRO-3: gathered pairwise)
        if self.lora_options.enabled:  # after the reference copy: the initial policy is the base model
            from arctic_rl.modules.lora import apply_lora

            apply_lora(self.model, self.lora_options)

    def configure_optimizers(self):
        hp = self.options.optim
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
        return self.regularizers.kl_coef > 0 or "ref_logprobs" in self.loss_inputs_needed

    def schedule_steps(self) -> int:
        """The learning-rate schedule's length in optimizer steps (``lr_schedule.schedule_length``)."""
        return schedule_length(self.trainer, self.options.optim.lr_schedule, self.mini_batches * self.num_iterations)

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

    @property
    def sync_tensors_stable(self) -> bool:
        """``named_parameters_for_sync`` yields tensors that stay valid until the walk ends: the parameters themselves
        or LoRA's merged copies, not a ZeRO-3 gather (valid one bucket at a time)."""
        from arctic_rl.strategies.zero import is_partitioned

        return not any(is_partitioned(p) for p in self.model.parameters())

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

    def check_first_batch(self, rollout: RolloutBatch) -> dict[str, float]:
        """The start-up self-check (``self_check.py``) on ``rollout`` if it has not run yet (and ``self_check``
        is on); call it inside the training step's forward context (ZeRO-3 gathers as in training). Returns its
        metrics, or {} when it does not run. Raises ``SelfCheckFailed``."""
        if self._self_checked:
            return {}
        from arctic_rl.modules.self_check import check_first_batch as self_check

        hp, self._self_checked = self.options.compute, True
        return self_check(self.model, rollout, hp.zorro, hp.attention_backend, self.options.sampling.temperature,
                          self.tokenizer.pad_token_id, hp.zorro_dedup).as_metrics()
