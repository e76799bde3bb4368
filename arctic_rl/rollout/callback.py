"""``RolloutCallback``: rollouts before each training step (or overlapped with the previous one), weight
sync after it."""

from __future__ import annotations

import json
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from arctic_rl.callbacks.summary import run_log_dir
from arctic_rl.data.prompts import PROMPT_IDS
from arctic_rl.errors import ConfigError
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, STREAM_GROUPS, RolloutBatch, StepBatch
from arctic_rl.rollout.engines.base import RolloutEngine, StopsAtDeadline, UpdatesInFlight
from arctic_rl.rollout.engines.factory import check_router_replay
from arctic_rl.rollout.engines.host import EngineHost, RayEngines
from arctic_rl.rollout.engines.kinds import EngineChoice
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.multi_turn import check_environment
from arctic_rl.rollout.openai.agent_server import close_agent_server
from arctic_rl.rollout.overlap import OverlappedRollouts, engine_stream, on_stream
from arctic_rl.rollout.policy import RolloutPolicy
from arctic_rl.rollout.rewards import samples_table
from arctic_rl.rollout.stream.stream import RolloutStream

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
        partial_rollout_tokens: with ``max_staleness >= 2``: the rollout stream (``rollout/stream/stream.py``). Each
            round of generation extends every unfinished sample by at most this many tokens while the trainer
            updates; a sample cut there is paused and continued by the next round with the newer weights, and each
            token keeps the version that sampled it (with ``model.rollout.environment`` each sample is an episode, also
            paused at a turn's end: docs/multi_turn.md). None: whole samples (the look-ahead above).
        over_provisioning: the stream's loader batches in flight beyond the step's own (1 to ``max_staleness - 1``):
            their prompts start generating early, and each step trains the oldest groups that are complete, so long
            samples go on while shorter ones train.
        rounds_per_step: the stream's rounds beside each training step; None: as many as the step leaves time for
            (the engine kept busy; which weights sample which segment then depends on timing, so two runs of one
            config differ: give a number for a reproducible run).
        stale_groups: what the stream does with a group that can no longer be trained within ``max_staleness``:
            ``regenerate`` it from its prompt, or ``drop`` it for a fresh prompt. Each is counted in the logs.
        partial_rollout_seconds: the stream's rounds also end after this many seconds (a budget in time beside
            ``partial_rollout_tokens``): each sample keeps what it has, one token at least, and is continued next round.
            With ``ray``, every replica ends its part of the round at the same wall-clock time (up to the nodes' clock
            skew). Where a round ends depends on timing: two runs differ.
        in_flight_weight_updates: the stream's new weights enter the engine while its round runs, between two decode
            steps, instead of after the round ends: the trainer does not wait for the round, and a sample may change
            weights mid-segment (its tokens keep the versions that sampled them; its KV cache is kept). In-process
            engines and Ray replicas (each takes the sync at a step boundary of its own decode). Which token the weights
            reach first depends on timing: two runs differ.
    """

    def __init__(
        self,
        engine: EngineChoice = "auto",
        engine_kwargs: dict[str, Any] | None = None,
        log_samples_every_n_steps: int = 20,
        num_logged_samples: int = 8,
        ray: RayEngines | None = None,
        max_staleness: int = 0,
        partial_rollout_tokens: int | None = None,
        over_provisioning: int = 1,
        rounds_per_step: int | None = None,
        stale_groups: Literal["regenerate", "drop"] = "regenerate",
        in_flight_weight_updates: bool = False,
        partial_rollout_seconds: float | None = None,
    ) -> None:
        self.host = EngineHost(engine, engine_kwargs, ray, where="RolloutCallback")  # the engines' lifecycle
        self.log_samples_every_n_steps, self.num_logged_samples = log_samples_every_n_steps, num_logged_samples
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ConfigError(f"RolloutCallback.max_staleness must be an integer >= 0, got {max_staleness!r}")
        self.max_staleness = max_staleness
        if partial_rollout_tokens is not None:
            if not isinstance(partial_rollout_tokens, int) or partial_rollout_tokens < 1:
                raise ConfigError(f"RolloutCallback.partial_rollout_tokens must be an integer >= 1 or null, got {partial_rollout_tokens!r}")
            if max_staleness < 2:
                raise ConfigError(f"RolloutCallback.partial_rollout_tokens needs max_staleness >= 2 (a paused sample is trained at least"
                                  f" two rollout batches after its first token), got max_staleness={max_staleness}")
            if not isinstance(over_provisioning, int) or not 1 <= over_provisioning < max_staleness:
                raise ConfigError(f"RolloutCallback.over_provisioning must be an integer from 1 to max_staleness - 1 ="
                                  f" {max_staleness - 1} (a group admitted that far ahead is trained that many batches on),"
                                  f" got {over_provisioning!r}")
            if rounds_per_step is not None and (not isinstance(rounds_per_step, int) or rounds_per_step < 1):
                raise ConfigError(f"RolloutCallback.rounds_per_step must be an integer >= 1 or null, got {rounds_per_step!r}")
        if in_flight_weight_updates and partial_rollout_tokens is None:
            raise ConfigError("RolloutCallback.in_flight_weight_updates needs the rollout stream (partial_rollout_tokens and"
                              " max_staleness >= 2): its rounds are what the weights enter while they run")
        self.in_flight_weight_updates = in_flight_weight_updates
        if partial_rollout_seconds is not None:
            if partial_rollout_tokens is None:
                raise ConfigError("RolloutCallback.partial_rollout_seconds needs the rollout stream (partial_rollout_tokens and"
                                  " max_staleness >= 2): it is a round's budget")
            if isinstance(partial_rollout_seconds, bool) or not isinstance(partial_rollout_seconds, (int, float)) or not partial_rollout_seconds > 0:
                raise ConfigError(f"RolloutCallback.partial_rollout_seconds must be a number > 0 or null, got {partial_rollout_seconds!r}")
        self.partial_rollout_seconds = partial_rollout_seconds
        if stale_groups not in ("regenerate", "drop"):
            raise ConfigError(f"RolloutCallback.stale_groups must be 'regenerate' or 'drop', got {stale_groups!r}")
        self.partial_rollout_tokens, self.stale_groups, self.over_provisioning = partial_rollout_tokens, stale_groups, over_provisioning
        self.rounds_per_step = rounds_per_step
        self.overlap: OverlappedRollouts | None = None  # max_staleness >= 1: the rollout generated ahead
        self.stream: RolloutStream | None = None  # partial_rollout_tokens: the rollout stream
        self._cuda_stream = None  # the stream's CUDA stream for an in-process CUDA engine
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
        self.host.check_ranks(trainer.world_size, trainer.num_nodes)
        check_environment(pl_module)
        if pl_module.options.rollout.agent is not None and self.partial_rollout_tokens is not None:
            raise ConfigError("model.rollout.agent does not take RolloutCallback.partial_rollout_tokens (the rollout stream"
                              " pauses and continues samples; an agent's episode runs whole): use max_staleness 0 or 1")
        if pl_module.options.corrections.router_replay:
            check_router_replay(self.host.kind)  # the engine must record each token's experts (vLLM here cannot)
            if self.partial_rollout_tokens is not None:
                raise ConfigError("model.corrections.router_replay does not take RolloutCallback.partial_rollout_tokens yet"
                                  " (a continued sample's routing spans rounds)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        # the engine starts from the trainer's weights as they are now: fresh, or restored from --ckpt_path
        # (on_train_start, not on_fit_start: with DeepSpeed, Lightning restores the checkpoint after setup)
        self.host.start(trainer, pl_module, every_rank=True)
        if self.partial_rollout_tokens is not None:
            self._start_stream(trainer, pl_module)
        elif self.max_staleness:
            self._start_overlap(trainer, pl_module, self.host.local_device)

    def _start_overlap(self, trainer: pl.Trainer, pl_module: RolloutPolicy, local_device: str | None) -> None:
        """``local_device``: an in-process engine's device (it then generates on its own CUDA stream)."""
        from arctic_rl.data.prompts import ResumableDataLoader

        if not isinstance(trainer.train_dataloader, ResumableDataLoader):
            raise ConfigError("RolloutCallback.max_staleness >= 1 needs the train loader of arctic_rl.PromptDataModule"
                              f" (it shows the next batch ahead of its step), got {type(trainer.train_dataloader).__name__}")

        cuda_stream = engine_stream(local_device)

        def generate(batch: dict, step: int):
            with on_stream(cuda_stream):
                return generate_rollout(self.engine, pl_module, batch, step, trainer.global_rank, trainer.world_size)

        steps_per_batch = self._steps_per_batch(pl_module)
        behaviour_as_old = not pl_module.corrections.vllm_importance_sampling_correction  # else: truncated IS weight
        self.overlap = OverlappedRollouts(generate, self.max_staleness, steps_per_batch, trainer.global_step, behaviour_as_old)
        self.overlap.load_state_dict(self._overlap_state)  # a resumed run continues with the rollout saved in flight

    def _start_stream(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        from arctic_rl.data.prompts import PromptDataModule, ResumableDataLoader
        from arctic_rl.rollout.dynamic_sampling import refill_prompts

        data = trainer.datamodule
        if not isinstance(trainer.train_dataloader, ResumableDataLoader) or not isinstance(data, PromptDataModule):
            raise ConfigError("RolloutCallback.partial_rollout_tokens needs arctic_rl.PromptDataModule and its train loader"
                              f" (the stream admits the next batch ahead of its step), got {type(data).__name__}")

        def refill(count: int, step: int, draw: int) -> dict[str, list]:  # a dropped group's replacement, fixed by its draw
            return refill_prompts(data.train_rows, [], count, data.seed, step, 1_000_000 + draw, trainer.global_rank)

        behaviour_as_old = not pl_module.corrections.vllm_importance_sampling_correction
        if self.partial_rollout_seconds is not None and not isinstance(self.engine, StopsAtDeadline):
            raise ConfigError(f"RolloutCallback.partial_rollout_seconds needs an engine that can stop at a deadline (the"
                              f" transformers or vLLM engine, in process or as Ray replicas); this run's is"
                              f" {type(self.engine).__name__}")
        if self.in_flight_weight_updates and not isinstance(self.engine, UpdatesInFlight):
            raise ConfigError(f"RolloutCallback.in_flight_weight_updates needs an engine that takes weights while it decodes"
                              f" (the transformers or vLLM engine, in process or as Ray replicas); this run's is"
                              f" {type(self.engine).__name__}")
        cuda_stream = engine_stream(self.host.local_device)  # an in-process CUDA engine generates beside training
        self.stream = RolloutStream(self.engine, pl_module, self.max_staleness, self.partial_rollout_tokens, self._steps_per_batch(pl_module),
                                    trainer.global_step, self.stale_groups, refill, trainer.global_rank, trainer.world_size, behaviour_as_old,
                                    rounds_per_step=self.rounds_per_step, on_round=lambda: on_stream(cuda_stream, wait=False),
                                    in_flight=self.in_flight_weight_updates, budget_s=self.partial_rollout_seconds)
        self._cuda_stream = cuda_stream
        self.stream.load_state_dict(self._overlap_state)  # a resumed run trains on every group the checkpoint holds

    def _upcoming(self, trainer: pl.Trainer, next_step: int, steps_per_batch: int) -> list[tuple[dict, int]]:
        """The next ``over_provisioning`` loader batches of the run with the steps they are handed over at."""
        upcoming = []
        for ahead in range(1, self.over_provisioning + 1):
            step = next_step + (ahead - 1) * steps_per_batch
            batch = None if 0 <= trainer.max_steps <= step else trainer.train_dataloader.batches.peek(ahead)
            if batch is None:
                break
            upcoming.append((batch, step))
        return upcoming

    @staticmethod
    def _steps_per_batch(pl_module: RolloutPolicy) -> int:
        return pl_module.mini_batches * pl_module.num_iterations  # optimizer steps per rollout batch

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: RolloutPolicy, batch: StepBatch, batch_idx: int) -> None:
        if self.stream is not None:
            step, next_step = trainer.global_step, trainer.global_step + self._steps_per_batch(pl_module)
            self.stream.admit(batch, step)
            rollout, metrics, batch[STREAM_GROUPS] = self.stream.take(len(batch[PROMPT_IDS]), step)
            if not 0 <= trainer.max_steps <= next_step:  # the run goes on: the next round runs beside this step
                if self._cuda_stream is not None:  # the rounds read the weights the last sync wrote on the default stream
                    self._cuda_stream.wait_stream(torch.cuda.current_stream(self._cuda_stream.device))
                self.stream.launch(self._upcoming(trainer, next_step, self._steps_per_batch(pl_module)), next_step)
            self._attach(trainer, batch, rollout, metrics)
            return
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
        next_step = trainer.global_step + self._steps_per_batch(pl_module)
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
        if self.stream is not None:
            if self.in_flight_weight_updates:
                self.stream.before_sync(trainer.global_step)  # the round goes on; its decode loop pauses for the weights
            else:
                self.stream.finish()  # the engine takes new weights between rounds
            if trainer.world_size > 1:
                trainer.strategy.barrier("arctic-rl-stream-sync")
        report = self.host.sync(pl_module)  # woken first: weights must land in an awake engine
        self._barrier_on_shared_pool(trainer, "arctic-rl-weights-synced")  # every rank's next rollout: the new weights
        pl_module.log("timing/sync_s", report.seconds, batch_size=1)
        pl_module.log("sync/gbytes", report.bytes / 1e9, batch_size=1)
        if self.stream is not None:
            self.stream.synced(trainer.global_step)
            for name, value in self.stream.pop_timing().items():
                pl_module.log(name, value, batch_size=1)

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
        if self.stream is not None:
            return {"stream": self.stream.state_dict()}
        return {"overlap": self.overlap.state_dict()} if self.overlap is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = "stream" if self.partial_rollout_tokens is not None else "overlap"
        self._overlap_state = state_dict.get(key, {}) if self.max_staleness else {}

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
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        close_agent_server()  # agent rollouts' endpoint, if one was started
        self.host.shutdown()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: RolloutPolicy) -> None:
        trainer.strategy.barrier("arctic-rl-rollout-shutdown")  # no rank may still be generating on shared engines
        self._shutdown()

    def on_exception(self, trainer: pl.Trainer, pl_module: RolloutPolicy, exception: BaseException) -> None:
        self._shutdown()
