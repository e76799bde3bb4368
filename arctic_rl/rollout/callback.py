"""``RolloutCallback``: rollouts before each training step (or overlapped with the previous one), weight
sync after it."""

from __future__ import annotations

import json
from typing import Any

import lightning.pytorch as pl

from arctic_rl.callbacks.summary import run_log_dir
from arctic_rl.errors import ConfigError
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, RolloutBatch, StepBatch
from arctic_rl.rollout.engines.base import RolloutEngine
from arctic_rl.rollout.engines.host import EngineHost, RayEngines
from arctic_rl.rollout.engines.kinds import EngineChoice
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.multi_turn import check_environment
from arctic_rl.rollout.overlap import OverlappedRollouts, engine_stream, on_stream
from arctic_rl.rollout.policy import RolloutPolicy
from arctic_rl.rollout.rewards import samples_table

__all__ = ["RayEngines", "RolloutCallback"]  # RayEngines: configs name it here (``arctic_rl.rollout.callback.RayEngines``)


class RolloutCallback(pl.Callback):
    """Generates with a rollout engine before each training step and pushes the new weights after.

    Args:
        engine: ``auto`` (vLLM when installed), ``vllm`` or ``transformers``.
        engine_kwargs: extra arguments of the engine (e.g. ``gpu_memory_utilization`` for vLLM); ``device``
            places an in-process engine (default: the trainer's device; e.g. ``cuda:1`` for a second GPU).
        log_samples_every_n_steps: write sample completions (a W&B table and ``samples.jsonl``) this
            often; 0 turns it off.
        num_logged_samples: completions per sample log.
        ray: run the engines as Ray actors (see :class:`RayEngines`); None: one in-process engine.
        max_staleness: 0: generate each batch before its step from the current weights (on-policy).
            k >= 1: generate batch t+1 while the trainer updates on batch t, from weights at most k steps
            old; weights are pushed only when needed to stay within k (``rollout/overlap.py``). Best with
            Ray engine actors (an in-process engine competes with training for the same cores or GPU).
    """

    def __init__(
        self,
        engine: EngineChoice = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        log_samples_every_n_steps: int = 20,
        num_logged_samples: int = 8,
        ray: RayEngines | None = None,
        max_staleness: int = 0,
    ) -> None:
        self.host = EngineHost(engine, engine_kwargs, ray, where="RolloutCallback")  # the engines' lifecycle
        self.log_samples_every_n_steps, self.num_logged_samples = log_samples_every_n_steps, num_logged_samples
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ConfigError(f"RolloutCallback.max_staleness must be an integer >= 0, got {max_staleness!r}")
        self.max_staleness = max_staleness
        self.overlap: OverlappedRollouts | None = None  # max_staleness >= 1: the rollout generated ahead
        self._overlap_state: dict = {}  # from a checkpoint, until the engine has started

    @property
    def engine(self) -> RolloutEngine | None:
        """The engine (or Ray pool) the rollouts are generated with; None before the run starts."""
        return self.host.engine

    @property
    def engine_kind(self) -> EngineChoice:
        return self.host.kind

    @property
    def engine_kwargs(self) -> dict[str, Any]:
        return self.host.engine_kwargs

    def setup(self, trainer: pl.Trainer, pl_module: RolloutPolicy, stage: str) -> None:
        self.host.check(pl_module)  # before any model or engine starts
        check_environment(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        # the engine starts from the trainer's weights as they are now: fresh, or restored from --ckpt_path
        # (on_train_start, not on_fit_start: with DeepSpeed, Lightning restores the checkpoint after setup)
        self.host.start(trainer, pl_module)
        if self.max_staleness:
            self._start_overlap(trainer, pl_module, self.host.local_device)

    def _start_overlap(self, trainer: pl.Trainer, pl_module: RolloutPolicy, local_device: str | None) -> None:
        """``local_device``: an in-process engine's device (it then generates on its own CUDA stream)."""
        from arctic_rl.data.prompts import ResumableDataLoader

        if not isinstance(trainer.train_dataloader, ResumableDataLoader):
            raise ConfigError("RolloutCallback.max_staleness >= 1 needs the train loader of arctic_rl.PromptDataModule"
                              f" (it shows the next batch ahead of its step), got {type(trainer.train_dataloader).__name__}")

        stream = engine_stream(local_device)

        def generate(batch: dict, step: int):
            with on_stream(stream):
                return generate_rollout(self.engine, pl_module, batch, step, trainer.global_rank, trainer.world_size)

        steps_per_batch = pl_module.mini_batches * pl_module.num_iterations  # optimizer steps per rollout batch
        behaviour_as_old = not pl_module.corrections.vllm_importance_sampling_correction  # else: truncated IS weight
        self.overlap = OverlappedRollouts(generate, self.max_staleness, steps_per_batch, trainer.global_step, behaviour_as_old)
        self.overlap.load_state_dict(self._overlap_state)  # a resumed run continues with the rollout saved in flight

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: RolloutPolicy, batch: StepBatch, batch_idx: int) -> None:
        if self.overlap is not None:
            rollout, metrics = self.overlap.take(batch, trainer.global_step)
            self._launch_next(trainer, pl_module)
            self._attach(trainer, batch, rollout, metrics)
            return
        rollout, metrics = generate_rollout(
            self.engine, pl_module, batch, trainer.global_step, trainer.global_rank, trainer.world_size
        )
        self._barrier_on_shared_pool(trainer, "arctic-rl-rollouts-done")  # no rank still generating when they sleep
        self.host.sleep()  # a colocated engine frees the accelerator while training runs
        self._attach(trainer, batch, rollout, metrics)

    def _barrier_on_shared_pool(self, trainer: pl.Trainer, name: str) -> None:
        """With several training ranks generating on one Ray pool: wait for every rank here, so that what rank 0 does to
        the replicas next (sleep, new weights) comes after every rank's calls before it (Ray orders an actor's calls
        per caller only)."""
        if trainer.world_size > 1 and self.host.shared_pool:
            trainer.strategy.barrier(name)

    def _launch_next(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        """Start generating the batch Lightning hands over next, unless the epoch or the run ends here
        (then that batch is generated when its step starts)."""
        next_step = trainer.global_step + pl_module.mini_batches
        if 0 <= trainer.max_steps <= next_step:
            return
        upcoming = trainer.train_dataloader.batches.peek()
        if upcoming is not None:
            self.overlap.launch(upcoming, next_step)

    def _attach(self, trainer: pl.Trainer, batch: StepBatch, rollout: RolloutBatch, metrics: dict[str, float]) -> None:
        batch[ROLLOUT], batch[ROLLOUT_METRICS] = rollout, metrics
        every = self.log_samples_every_n_steps
        if every and trainer.global_step % every == 0:
            self._log_samples(trainer, rollout)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: RolloutPolicy, outputs: Any, batch: StepBatch, batch_idx: int) -> None:
        if self.overlap is not None:
            self._sync_overlapped(trainer, pl_module)
            return
        report = self.host.sync(pl_module)  # woken first: weights must land in an awake engine
        self._barrier_on_shared_pool(trainer, "arctic-rl-weights-synced")  # every rank's next rollout: the new weights
        pl_module.log("timing/sync_s", report.seconds, batch_size=1)
        pl_module.log("sync/gbytes", report.bytes / 1e9, batch_size=1)

    def _sync_overlapped(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        """Finish the rollout generated ahead, then push the weights if the staleness bound needs it (the
        engine never sleeps: it generates while training runs)."""
        self.overlap.finish_pending()
        pushed = self.overlap.needs_sync(trainer.global_step)
        if pushed:
            if trainer.world_size > 1:  # every rank's look-ahead must be done before the engines take new weights
                trainer.strategy.barrier("arctic-rl-overlap-sync")
            report = self.host.sync(pl_module)
            self.overlap.synced(trainer.global_step)
        pl_module.log("timing/sync_s", report.seconds if pushed else 0.0, batch_size=1)
        pl_module.log("sync/gbytes", report.bytes / 1e9 if pushed else 0.0, batch_size=1)
        pl_module.log("timing/rollout_wait_s", self.overlap.pop_wait_s(), batch_size=1)

    def state_dict(self) -> dict[str, Any]:
        """With ``max_staleness >= 1``: the rollout generated ahead (a resume trains on it as the
        uninterrupted run would); nothing otherwise."""
        return {"overlap": self.overlap.state_dict()} if self.overlap is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._overlap_state = state_dict.get("overlap", {}) if self.max_staleness else {}

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
        if self.overlap is not None:
            self.overlap.close()  # a generation in flight ends before its engine does
            self.overlap = None
        self.host.shutdown()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        trainer.strategy.barrier("arctic-rl-rollout-shutdown")  # no rank may still be generating on shared engines
        self._shutdown()

    def on_exception(self, trainer: pl.Trainer, pl_module: RolloutPolicy, exception: BaseException) -> None:
        self._shutdown()
