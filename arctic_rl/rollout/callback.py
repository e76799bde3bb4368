"""``RolloutCallback``: rollouts before each training step, weight sync after it."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl

from arctic_rl.callbacks.summary import run_log_dir
from arctic_rl.rollout.engine import RolloutEngine
from arctic_rl.rollout.engine_factory import make_engine
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.rewards import samples_table
from arctic_rl.temp_dirs import run_temp_dir
from arctic_rl.weight_sync import InProcessWeightSync


@dataclass
class RayEngines:
    """Rollout engines as Ray actors instead of one in-process engine.

    Args:
        address: Ray cluster to join (``auto``: the one ``ray start`` made on this node); None starts a
            local cluster when none is running.
        num_engines: engine actors.
        num_cpus_per_engine: Ray CPUs reserved per engine.
        num_gpus_per_engine: GPUs per engine (fractional: colocated with training on the same GPU).
        placement_strategy: ``PACK`` (colocate) or ``SPREAD`` (over nodes).
        weight_sync_backend: ``gloo``, ``nccl`` or ``cuda_ipc`` (engines colocated on the GPU of training
            rank 0, the sender, map its buffers; no copy over a wire). None: nccl when engines have GPUs, else gloo.
        weight_sync_bucket_mb: broadcast bucket size (``cuda_ipc``: each of its two shared buffers).
        timeout_s: engine start-up and per-sync timeout.
    """

    address: str | None = None
    num_engines: int = 1
    num_cpus_per_engine: float = 1.0
    num_gpus_per_engine: float = 0.0
    placement_strategy: str = "PACK"
    weight_sync_backend: str | None = None
    weight_sync_bucket_mb: int = 256
    timeout_s: float = 300.0


class RolloutCallback(pl.Callback):
    """Generates with a rollout engine before each training step and pushes the new weights after.

    Args:
        engine: ``auto`` (vLLM when installed), ``vllm`` or ``transformers``.
        engine_kwargs: extra arguments of the engine (e.g. ``gpu_memory_utilization`` for vLLM).
        log_samples_every_n_steps: write sample completions (a W&B table and ``samples.jsonl``) this
            often; 0 turns it off.
        num_logged_samples: completions per sample log.
        ray: run the engines as Ray actors (see :class:`RayEngines`); None: one in-process engine.
    """

    def __init__(
        self,
        engine: Literal["auto", "vllm", "transformers"] = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        log_samples_every_n_steps: int = 20,
        num_logged_samples: int = 8,
        ray: RayEngines | None = None,
    ) -> None:
        if engine not in ("auto", "vllm", "transformers"):
            raise ValueError(f"RolloutCallback.engine must be 'auto', 'vllm' or 'transformers', got {engine!r}")
        self.engine_kind, self.engine_kwargs = engine, dict(engine_kwargs or {})
        self.log_samples_every_n_steps, self.num_logged_samples = log_samples_every_n_steps, num_logged_samples
        self.ray = ray
        self._started_ray = False
        self.engine: RolloutEngine | None = None
        self._engine_dir: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module) -> None:
        # the engine starts from the trainer's weights as they are now: fresh, or restored from --ckpt_path
        # (on_train_start, not on_fit_start: with DeepSpeed, Lightning restores the checkpoint after setup)
        self._engine_dir = tempfile.mkdtemp(prefix="arctic-rl-engine-", dir=run_temp_dir())  # see temp_dirs.py
        pl_module.save_policy(self._engine_dir)
        hp = pl_module.hparams
        engine_args = dict(
            dtype=hp.dtype,
            max_model_len=pl_module.max_prompt_length + pl_module.max_response_length,
            seed=hp.seed,
            device=str(pl_module.device),
            engine_kwargs=self.engine_kwargs,
        )
        if self.ray is not None:
            from arctic_rl.cluster.engine_pool import share_engine_pool

            self.engine, self.weight_sync, self._started_ray = share_engine_pool(
                trainer, self.ray, self.engine_kind, self._engine_dir, engine_args
            )
            return
        self.engine = make_engine(self.engine_kind, self._engine_dir, **engine_args)
        self.weight_sync = InProcessWeightSync(self.engine)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch: dict, batch_idx: int) -> None:
        rollout, metrics = generate_rollout(
            self.engine, pl_module, batch, trainer.global_step, trainer.global_rank, trainer.world_size
        )
        self.engine.sleep()  # a colocated engine frees the accelerator while training runs
        batch["rollout"], batch["rollout_metrics"] = rollout, metrics
        every = self.log_samples_every_n_steps
        if every and trainer.global_step % every == 0:
            self._log_samples(trainer, rollout)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs: Any, batch: dict, batch_idx: int) -> None:
        self.engine.wake_up()  # weights must land in an awake engine (vLLM restores slept weights on wake-up)
        report = self.weight_sync.sync(pl_module.named_parameters_for_sync())
        pl_module.log("timing/sync_s", report.seconds, batch_size=1)
        pl_module.log("sync/gbytes", report.bytes / 1e9, batch_size=1)

    def _log_samples(self, trainer: pl.Trainer, rollout) -> None:
        columns, rows = samples_table(rollout, trainer.global_step, self.num_logged_samples)  # named rewards too
        for logger in trainer.loggers:
            if type(logger).__name__ == "WandbLogger":
                logger.log_table(key="samples", columns=columns, data=rows)
        if trainer.is_global_zero:  # not trainer.log_dir: that is a collective, and only rank 0 writes
            directory = run_log_dir(trainer)
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / "samples.jsonl", "a") as f:
                for row in rows:
                    f.write(json.dumps(dict(zip(columns, row))) + "\n")

    def _shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self._engine_dir is not None:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def on_fit_end(self, trainer: pl.Trainer, pl_module) -> None:
        trainer.strategy.barrier("arctic-rl-rollout-shutdown")  # no rank may still be generating on shared engines
        self._shutdown()

    def on_exception(self, trainer: pl.Trainer, pl_module, exception: BaseException) -> None:
        self._shutdown()
