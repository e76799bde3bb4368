"""``ArcticStrategy``: Lightning's ``DeepSpeedStrategy`` (ZeRO stage 1, 2 or 3) that also runs on CPU
with gloo, accumulates gradients right under ``GRPOModule``'s manual optimization, writes checkpoints
atomically and restores every rank's RNG on resume.

    arctic-rl fit --config configs/quickstart.yaml --trainer.strategy.class_path arctic_rl.strategies.ArcticStrategy

    trainer:
      strategy:
        class_path: arctic_rl.strategies.ArcticStrategy
        init_args:
          stage: 3
          offload_optimizer: true
          config: {zero_optimization: {stage3_param_persistence_threshold: 0}}   # raw DeepSpeed keys win

Precision comes from the Trainer (``precision: bf16-mixed`` turns on DeepSpeed's bf16); gradient
clipping from the module (``GRPOModule.max_grad_norm``, handed over in ``configure_model``). A module whose
``checkpoint_trainable_only`` is true (GRPOModule with LoRA, stages 1/2) is checkpointed without any frozen
parameter and loaded back strictly (exactly its trainable weights).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

import arctic_rl.strategies.checkpoint as atomic
from arctic_rl.errors import ConfigError
from arctic_rl.patches.deepspeed import skip_shm_comm_op
from arctic_rl.patches.lightning import PathLike, init_deepspeed_distributed
import arctic_rl.strategies.rng_state as rng_state
from arctic_rl.strategies.build_lock import check_build_locks

RNG_FILE = "rng_state_rank{rank}.pt"
# ops DeepSpeed may JIT-build at start-up: its CPU collectives; its fused optimizers on CUDA
JIT_OPS_CPU = ("cpu_adam",)  # the shm op is not built (``patches.deepspeed.skip_shm_comm_op``)
JIT_OPS_CUDA = ("fused_adam", "cpu_adam")


def deep_merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``overrides``, recursing into nested dicts (``overrides`` wins)."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def build_config(
    stage: int, offload_optimizer: bool, offload_parameters: bool, config: dict[str, Any] | str | Path | None
) -> dict[str, Any]:
    """The DeepSpeed config: the typed knobs, then ``config`` (a dict or a JSON file) merged over them."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ArcticStrategy.stage must be 1, 2 or 3, got {stage!r}")
    if offload_parameters and stage != 3:
        raise ValueError(f"ArcticStrategy.offload_parameters needs stage 3 (ZeRO-{stage} does not partition parameters)")
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    base = {
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the module's own torch optimizer (AdamW), wrapped by ZeRO
        # GRPOModule makes a variable number of backward passes (micro-batches) per optimizer step; in
        # unmanaged mode DeepSpeed accumulates until step() instead of counting to a fixed number
        "managed_gradient_accumulation": False,
        "steps_per_print": 2**31 - 1,  # Lightning logs; keep DeepSpeed's progress lines out of the output
    }
    if config is None:
        return base
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"ArcticStrategy.config: DeepSpeed config file not found: {path}")
        with open(path) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"ArcticStrategy.config must be a dict or a path to a JSON file, got {type(config).__name__}")
    merged = deep_merge(base, config)
    if merged["zero_optimization"].get("stage") not in (1, 2, 3):
        raise ValueError(f"ArcticStrategy.config: zero_optimization.stage must be 1, 2 or 3, got {merged['zero_optimization'].get('stage')!r}")
    return merged


def frozen_names(module: torch.nn.Module) -> set[str]:
    """Every name of ``module``'s frozen parameters, a tied parameter's aliases included."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


@contextmanager
def _module_state_of_trainable(engine) -> Iterator[None]:
    """While saving: ``engine.module_state_dict`` without any frozen parameter. DeepSpeed's own
    ``exclude_frozen_parameters`` drops each frozen parameter under one name only, so a tied output head
    (``lm_head.weight`` = the embedding) would still be written whole."""
    original = engine.module_state_dict

    def trainable(*args: Any, **kwargs: Any) -> dict[str, Any]:
        state, frozen = original(*args, **kwargs), frozen_names(engine.module)
        for name in [name for name in state if name in frozen]:
            del state[name]
        return state

    engine.module_state_dict = trainable  # this instance only, for this save
    try:
        yield
    finally:
        del engine.module_state_dict


def load_trainable(src: Mapping[str, torch.Tensor], dst: torch.nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn`` for a checkpoint of the trainable weights only: ``src`` must hold exactly
    ``dst``'s trainable parameters and buffers (a ``ConfigError`` naming ``model.lora`` otherwise), then loads them."""
    frozen = frozen_names(dst)
    have, want = set(src), {name for name in dst.state_dict() if name not in frozen}
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise ConfigError(f"the checkpoint's weights are not this model's trainable ones (model.lora: its adapters): "
                          f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                          f"{'...' if len(extra) > 3 else ''}")
    dst.load_state_dict(src, strict=False)


def guarded_step(strategy, model: torch.nn.Module, optimizer, max_grad_norm: float | None) -> tuple[float, bool]:
    """Clip ``model``'s gradients to ``max_grad_norm`` (None or 0: no clipping) and step ``optimizer``, under any
    strategy, unless the global gradient norm is not finite: then the step is skipped (weights and optimizer state
    untouched, gradients cleared) but still counted, so ``global_step`` and the schedule advance as for any step.

    Plain torch: the gradients are every rank's already (DDP averages in backward), so every rank measures the same
    norm; a skipped step calls ``optimizer.step()`` with every gradient cleared, which AdamW steps over nothing.
    DeepSpeed reduces, clips (config ``gradient_clipping`` = ``max_grad_norm``) and measures inside its step, over
    every rank's partition, and its ZeRO optimizers skip a step whose norm is not finite themselves (in fp32, and in
    bf16 under ``bf16.check_grad_overflow``, on by default); ``engine.skipped_steps`` tells.

    Returns:
        ``(grad_norm, skipped)``: the norm before clipping and whether the step was skipped.
    """
    if isinstance(strategy, ArcticStrategy):
        engine = strategy.deepspeed_engine
        skipped_before = engine.skipped_steps
        optimizer.step()
        measured, skipped = engine.get_global_grad_norm(), engine.skipped_steps > skipped_before
        norm = math.nan if measured is None else float(measured)  # None: DeepSpeed measured none (compute_grad_norm off)
        if measured is not None and not skipped and not math.isfinite(norm):  # not with DeepSpeed's overflow check on
            raise FloatingPointError(f"DeepSpeed applied a step whose gradient norm is {norm}; keep "
                                     "bf16.check_grad_overflow on in ArcticStrategy.config")
        return norm, skipped
    params = [p for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf")))  # 0: no clipping (DeepSpeed's meaning too)
    skipped = not math.isfinite(norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)  # AdamW steps only parameters with a gradient: none
    optimizer.step()
    return norm, skipped


def model_builder(trainer, max_grad_norm: float | None, owner: str):
    """A context yielding ``build(source, dtype)``: ``build_causal_lm``, or under DeepSpeed what
    ``ArcticStrategy.model_builder`` yields (ZeRO-3: partitioned while built; clipping handed over).
    ``trainer`` None: built outside a Trainer; ``owner`` names the module in the error for another DeepSpeed strategy."""
    import contextlib

    from arctic_rl.causal_lm import build_causal_lm

    strategy = trainer.strategy if trainer is not None else None
    if not isinstance(strategy, DeepSpeedStrategy):
        return contextlib.nullcontext(build_causal_lm)
    if not isinstance(strategy, ArcticStrategy):
        raise TypeError(f"{owner} needs arctic_rl.strategies.ArcticStrategy for DeepSpeed, got {type(strategy).__name__}")
    return strategy.model_builder(max_grad_norm=max_grad_norm)


class ArcticStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO for arctic-rl, on CUDA or CPU.

    Args:
        stage: ZeRO stage: 1 partitions optimizer states, 2 also gradients, 3 also parameters (the
            model is partitioned while it is built, in ``configure_model``).
        offload_optimizer: keep optimizer states (and the step) in CPU memory.
        offload_parameters: keep partitioned parameters in CPU memory (stage 3).
        config: raw DeepSpeed config (dict or JSON path) merged over what the knobs above produce; its
            keys win. ``gradient_accumulation_steps`` is not allowed (Lightning sets it).
        process_group_backend: ``nccl`` / ``gloo`` (default: nccl on GPU, gloo on CPU).
    """

    strategy_name = "arctic"

    def __init__(
        self,
        stage: Literal[1, 2, 3] = 2,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        config: dict[str, Any] | str | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        # the Trainer sets accelerator, devices, cluster environment and precision on the instance later
        merged = build_config(stage, offload_optimizer, offload_parameters, config)
        self._user_gradient_clipping = merged.get("gradient_clipping")
        super().__init__(config=merged, process_group_backend=process_group_backend)
        self._worker_device: torch.device | None = None  # set by use_ray_train_worker()

    def use_ray_train_worker(self, cluster_environment, device: torch.device) -> None:
        """Run as one Ray Train worker: ranks come from ``cluster_environment`` (Ray's Lightning
        environment) and the device from Ray, which shows each worker only its own GPU."""
        self.cluster_environment = cluster_environment
        self._worker_device = device

    @property
    @override
    def root_device(self) -> torch.device:
        # Lightning indexes its device list by local rank, which is wrong when Ray hides the other GPUs
        return self._worker_device if self._worker_device is not None else super().root_device

    # ------------------------------------------------------------------ CPU support
    @override
    def setup_environment(self) -> None:
        # DeepSpeedStrategy refuses every accelerator but CUDA, yet DeepSpeed runs ZeRO 1/2/3 on its CPU
        # accelerator with gloo; allowing CPU is what lets CI exercise real ZeRO
        if not isinstance(self.accelerator, (CUDAAccelerator, CPUAccelerator)):
            raise RuntimeError(f"ArcticStrategy runs on CUDA or CPU, not {type(self.accelerator).__name__}")
        if isinstance(self.accelerator, CPUAccelerator):
            from deepspeed.accelerator import get_accelerator

            if get_accelerator().device_name() != "cpu":
                raise RuntimeError(
                    f"Trainer(accelerator='cpu') but DeepSpeed chose its {get_accelerator().device_name()!r} accelerator;"
                    " set DS_ACCELERATOR=cpu in the environment to run ZeRO on CPU"
                )
        check_build_locks(JIT_OPS_CPU if isinstance(self.accelerator, CPUAccelerator) else JIT_OPS_CUDA)
        DDPStrategy.setup_environment(self)  # the grandparent: skip DeepSpeedStrategy's CUDA-only check

    @override
    def setup_distributed(self) -> None:
        if isinstance(self.accelerator, CUDAAccelerator):
            return super().setup_distributed()
        # the parent first checks that CUDA device indices equal local ranks; CPU devices have no index
        # (index None), so that check fails. The rest is the parent's: seed, ranks, process group.
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        skip_shm_comm_op()  # a JIT-built C++ op for inference all-reduces only: no compile, no build lock on CPU
        init_deepspeed_distributed(self)

    def _device_rank(self) -> int:
        # DeepSpeed compares args.device_rank with 0; a CPU device's index is None, so use the local rank
        index = self.root_device.index
        return self.local_rank if index is None else index

    @override
    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        # as the parent, but with a device_rank that is an int on CPU too (see _device_rank)
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer

    @override
    def _initialize_deepspeed_inference(self, model) -> None:
        # as the parent (validate/predict without an optimizer), but with an int device_rank on CPU
        import deepspeed

        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}  # DeepSpeed's throughput timers need it
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.zero_stage_3:
            config.update({k: self.config[k] for k in ("zero_allow_untested_optimizer", "zero_optimization")})
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    # ------------------------------------------------------------------ manual optimization
    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        # GRPOModule runs several micro-batch forward/backward passes inside one engine forward (Lightning's
        # training_step). DeepSpeed opens a new micro-step only in engine.forward; without this call ZeRO-3
        # would overwrite, not add, each micro-batch's gradient partition and keep only the last one.
        from deepspeed.runtime.base_optimizer import ZeROOptimizer

        zero_optimizer = self.deepspeed_engine.optimizer
        if isinstance(zero_optimizer, ZeROOptimizer):  # exactly what DeepSpeedEngine.forward does first
            zero_optimizer.clear_backward_seen_flag()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @contextmanager
    def model_builder(self, max_grad_norm: float | None) -> Iterator[Callable[[str | dict[str, Any], str], torch.nn.Module]]:
        """Yields the function that builds the LightningModule's transformers models, ``build(source, dtype)``,
        for ``configure_model`` (which Lightning runs inside ``deepspeed.zero.Init`` on ZeRO-3).

        ZeRO-3 gets :func:`~arctic_rl.strategies.zero.build_partitioned_causal_lm` (partitioned while built;
        weights loaded or initialised a bucket at a time); stages 1/2 build the whole model as usual. Also
        puts ``max_grad_norm`` (the module's) in the config before DeepSpeed starts, since DeepSpeed clips
        inside its optimizer step (None: no clipping)."""
        from arctic_rl.causal_lm import build_causal_lm
        from arctic_rl.strategies.zero import build_partitioned_causal_lm

        user = self._user_gradient_clipping
        if user is not None and float(user) != float(max_grad_norm or 0.0):
            raise ValueError(
                f"ArcticStrategy.config gradient_clipping={user} disagrees with model.optim.max_grad_norm={max_grad_norm};"
                " set it in one place (model.optim.max_grad_norm)"
            )
        self.config["gradient_clipping"] = float(max_grad_norm or 0.0)
        yield build_partitioned_causal_lm if self.zero_stage_3 else build_causal_lm

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict, filepath: PathLike, storage_options: Any | None = None) -> None:
        # the parent writes into `filepath` in place: a crash mid-write leaves a corrupt `last.ckpt`. Here
        # every rank writes into a fresh staging directory, and rank 0 publishes it atomically when all are
        # done (see arctic_rl.strategies.checkpoint). Each rank's RNG state goes in too, for exact resume.
        if storage_options is not None:
            raise TypeError(f"storage_options is not supported by {type(self).__name__} (CheckpointIO is not used)")
        filepath = self.broadcast(str(filepath))
        staging = Path(self.broadcast(str(atomic.new_staging_dir(filepath)) if self.is_global_zero else None))
        client_state = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        trainable_only = self._trainable_only()
        with _module_state_of_trainable(self.deepspeed_engine) if trainable_only else nullcontext():
            self.deepspeed_engine.save_checkpoint(
                str(staging), client_state=client_state, tag="checkpoint", exclude_frozen_parameters=trainable_only
            )
        rng_state.save(staging / RNG_FILE.format(rank=self.global_rank))  # plain data: loads with weights_only=True
        self.barrier("arctic_checkpoint_written")
        if self.is_global_zero:
            atomic.publish(staging, filepath)
        self.barrier("arctic_checkpoint_published")

    @override
    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """DeepSpeed's load, then this rank's RNG state. The RNG file is always read with ``weights_only=True``;
        with ``weights_only=True`` DeepSpeed's own files are too (:mod:`arctic_rl.strategies.safe_load`), and an
        RNG file that is not plain data is an error (``pickle.UnpicklingError``) rather than a warning."""
        import pickle

        rng_file = Path(checkpoint_path) / RNG_FILE.format(rank=self.global_rank)
        states = None
        if rng_file.is_file():  # absent in checkpoints written by Lightning's DeepSpeedStrategy
            try:
                states = rng_state.load(rng_file)
            except (pickle.UnpicklingError, ValueError) as e:
                if weights_only:
                    raise pickle.UnpicklingError(f"{checkpoint_path}: {rng_file.name}: {e}") from None
                rank_zero_warn(f"{checkpoint_path}: {rng_file.name} is not plain data (a checkpoint of an older "
                               "arctic-rl?); it is not unpickled, and random streams restart from the seed")
        else:
            rank_zero_info(f"{checkpoint_path}: no per-rank RNG state saved; random streams restart from the seed")
        engine = self.deepspeed_engine
        default_engine = engine.checkpoint_engine
        if weights_only:
            from arctic_rl.strategies.safe_load import WeightsOnlyCheckpointEngine  # imports DeepSpeed: only here

            engine.checkpoint_engine = WeightsOnlyCheckpointEngine()  # loads only; its save settings are unused
        try:
            if self._trainable_only():
                client_state = self._load_trainable_only(checkpoint_path)
            else:
                client_state = super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            engine.checkpoint_engine = default_engine
        if states is not None:
            rng_state.restore(states)
        return client_state

    def _trainable_only(self) -> bool:
        """Whether checkpoints hold the trainable parameters (and buffers) only: the module says so
        (``checkpoint_trainable_only``: GRPOModule with LoRA adapters, whose frozen base and reference are rebuilt
        from ``model.model`` on resume), or ``exclude_frozen_parameters``."""
        return bool(self.exclude_frozen_parameters) or bool(getattr(self.lightning_module, "checkpoint_trainable_only", False))

    def _load_trainable_only(self, checkpoint_path: PathLike) -> dict[str, Any]:
        """Lightning's DeepSpeed load, with the module's weights loaded by :func:`load_trainable` (exactly the
        trainable parameters and buffers, nothing missing or extra) instead of a non-strict ``load_state_dict``."""
        from lightning.pytorch.trainer.states import TrainerFn

        if not Path(checkpoint_path).is_dir():
            raise FileNotFoundError(f"{checkpoint_path}: not a DeepSpeed checkpoint directory (ArcticStrategy writes one)")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        _, client_state = self.deepspeed_engine.load_checkpoint(
            str(checkpoint_path), load_optimizer_states=fitting, load_lr_scheduler_states=False, custom_load_fn=load_trainable
        )
        if client_state is None:
            raise RuntimeError(f"{checkpoint_path}: DeepSpeed found no checkpoint to load (no 'latest' tag file?)")
        return client_state

    @override
    def remove_checkpoint(self, filepath: PathLike) -> None:
        # our checkpoints are a symlink plus a hidden directory; the parent would remove only the link
        if self.is_global_zero:
            atomic.remove(filepath)
