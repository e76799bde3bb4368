"""``ServiceModule``: the ``PolicyModule`` the service runs, and ``ServiceEngines``, its engines' lifecycle. Its
training loop's "batches" are requests: each training step takes one :class:`Command` and runs it with the code
paths ``arctic-rl fit`` runs (``PolicyModule``: ZoRRo log-probs, the micro-batch backward, DeepSpeed's step;
``EngineHost``: the engines and weight sync ``RolloutCallback`` holds too)."""

from __future__ import annotations

import os
import pickle
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from arctic_rl.patches.lightning import restore_checkpoint
import lightning.pytorch as pl

from arctic_rl.modules.losses import LossNormalizer
from arctic_rl.modules.policy_module import PolicyModule
from arctic_rl.rollout.engines.base import Completion, DecodeListener, SamplingConfig
from arctic_rl.rollout.engines.host import EngineHost, RayEngines
from arctic_rl.serve import registry, targets
from arctic_rl.serve.batch import AdamSettings, TrainBatch
from arctic_rl.serve.errors import JobFailed, RequestError, ServiceError


@dataclass
class Command:
    """One request for the training loop: the ``ServiceModule`` method ``op_<name>`` with ``kwargs``."""

    name: str
    kwargs: dict[str, Any]
    future: Future = field(default_factory=Future)

    def run(self, module: "ServiceModule") -> None:
        """Run it and hand the answer to the caller; a ``JobFailed`` (an engine replica died) also ends the loop."""
        if not self.future.set_running_or_notify_cancel():  # the caller gave up (timeout) before it started
            return
        try:
            self.future.set_result(module.run_operation(self.name, self.kwargs))
        except JobFailed as e:  # the caller's answer, and the job's end: Trainer.fit stops, every later call is JobFailed
            self.future.set_exception(e)
            raise
        except BaseException as e:  # noqa: BLE001  (handed to the caller; the loop serves on)
            self.future.set_exception(e)


# Operations that gather or write the whole model (ZeRO-3: GatheredParameters, checkpoints). ``arctic-rl fit``
# runs them after the training step, outside DeepSpeed's forward, whose ZeRO-3 hooks hold the root module's
# parameters; the service runs them at the same point.
OUTSIDE_FORWARD = frozenset({"sync_weights", "save_state", "load_state", "export"})


class ServiceEngines(pl.Callback):
    """The service's rollout engines: an :class:`EngineHost` started with the job (from the trainer's weights) and
    shut down with it. Sampling and weight pushes are the client's operations (``ServiceModule``).

    Several training ranks (``training.devices x num_nodes > 1``): rank 0 holds the in-process engine and sends the
    weights; every other rank holds no engine and only takes part in gathering the weights. With engines as Ray actors
    (``engines.launcher: ray``) no engine lives in a rank's process: rank 0 starts the replicas and sends them the
    weights, every other rank attaches to them (``ray/pool.py``), so vLLM works beside any number of ranks.

    Args:
        engine, engine_kwargs, ray, in_rank_bundles: as for :class:`EngineHost`.
    """

    def __init__(self, engine: str = "auto", engine_kwargs: dict[str, Any] | None = None, ray: RayEngines | None = None,
                 in_rank_bundles: bool = False) -> None:
        self.host = EngineHost(engine, engine_kwargs, ray, where="engines", in_rank_bundles=in_rank_bundles)

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.host.check(pl_module)  # before any model or engine starts

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.is_global_zero or self.host.ray is not None:
            self.host.start(trainer, pl_module)
        else:
            self.host.start_without_engine(pl_module)  # rank 0's start-up save is a collective under ZeRO-3

    def on_fit_end(self, trainer, pl_module) -> None:
        trainer.strategy.barrier("arctic-rl-rollout-shutdown")  # no rank may still be using shared engines
        self.host.shutdown()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.host.shutdown()


class ServiceModule(PolicyModule):
    """The policy with the service's extra knobs and its operations; rewards and advantages are the client's.

    Args:
        colocated: the engines share the training accelerator: they sleep (free their memory) for forward,
            forward_backward and optim_step, and wake for sample and sync_weights.
        reference_model: keep a frozen copy of the initial policy (for ``ref_logprobs`` and KL losses).
        total_steps: optimizer steps a decaying ``lr_schedule`` runs over.
        policy_kwargs: PolicyModule's arguments (``sampling.group_size`` None: requests carry their own groups).
    """

    def __init__(self, colocated: bool = False, reference_model: bool = False, total_steps: int | None = None,
                 **policy_kwargs: Any) -> None:
        super().__init__(**policy_kwargs)
        self.colocated, self.keep_reference, self.total_steps = colocated, reference_model, total_steps
        self._after_step: Command | None = None
        self.engines: ServiceEngines | None = None  # set by the core before fit
        self.on_ready = threading.Event()

    # ------------------------------------------------------------------ PolicyModule hooks
    @property
    def needs_reference_model(self) -> bool:
        return self.keep_reference or super().needs_reference_model

    def schedule_steps(self) -> int:
        return 0 if self.options.optim.lr_schedule == "constant" else int(self.total_steps or 0)

    def configure_callbacks(self) -> list:
        from arctic_rl.callbacks.atomic_checkpoints import AtomicCheckpoints

        return [AtomicCheckpoints()]

    def on_train_start(self) -> None:
        self.on_ready.set()  # the model is built, the optimizer set up, the engines started (callbacks run first)

    def training_step(self, dataloader_iter) -> None:
        command, _, _ = next(dataloader_iter)  # StopIteration (the core's close) ends the loop
        if command.name in OUTSIDE_FORWARD:
            self._after_step = command  # run where fit runs them: after the step (outside DeepSpeed's forward)
        else:
            command.run(self)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        command, self._after_step = self._after_step, None
        if command is not None:
            command.run(self)

    def run_operation(self, name: str, kwargs: dict[str, Any]) -> Any:
        operations = {"sample": self.op_sample, "forward": self.op_forward, "forward_backward": self.op_forward_backward,
                      "optim_step": self.op_optim_step, "zero_grad": self.op_zero_grad, "sync_weights": self.op_sync_weights,
                      "sleep": self.op_sleep, "wake": self.op_wake, "save_state": self.op_save_state,
                      "load_state": self.op_load_state, "export": self.op_export, "status": self.op_status}
        return operations[name](**kwargs)

    # ------------------------------------------------------------------ operations
    def op_sample(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                  listener: DecodeListener | None = None) -> list[list[Completion]]:
        vocab = self.model.config.get_text_config().vocab_size
        for i, prompt in enumerate(prompt_token_ids):
            if not prompt or len(prompt) > self.max_prompt_length:
                raise RequestError(f"prompts[{i}] has {len(prompt)} tokens; need 1..sampling.max_prompt_length={self.max_prompt_length}")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise RequestError(f"prompts[{i}] has a token id outside [0, {vocab})")
        if sampling.max_tokens > self.max_response_length:
            raise RequestError(f"max_tokens={sampling.max_tokens} is over sampling.max_response_length={self.max_response_length}")
        if not self.holds_engine():
            raise RequestError(f"training rank {self.global_rank} holds no engine: rank 0 samples")
        self._engines_needed(True)
        from arctic_rl.rollout.engines.ray.pool import ReplicaFailed

        try:
            return self.engines.host.generate(prompt_token_ids, sampling, listener)
        except ReplicaFailed as e:  # the pool is short of a replica (and its weight-sync group broken): the job ends
            raise JobFailed(str(e)) from e

    def holds_engine(self) -> bool:
        """Whether this training rank has the engines (rank 0 of several; the only rank otherwise)."""
        return self.engines is not None and self.engines.host.engine is not None

    def _engines_needed(self, needed: bool) -> None:
        """Colocated engines: awake for sampling and weight pushes, asleep while training computes."""
        if self.colocated:
            self.op_wake() if needed else self.op_sleep()

    def _rollout_batch(self, batch: TrainBatch):
        self._engines_needed(False)
        batch.check_limits(self.model.config.get_text_config().vocab_size, self.max_prompt_length, self.max_response_length)
        return batch.to_rollout_batch(self.tokenizer.pad_token_id).to(self.device)

    def _with_reference(self, rollout, needed: bool):
        if needed and rollout.ref_logprobs is None:
            if self.ref_model is None:
                raise RequestError("reference log-probs need a reference model: set training.reference_model: true")
            rollout.ref_logprobs = self._logprobs_of(self.ref_model, rollout)[0]
        return rollout

    def _logprobs_of(self, model, rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``[N, R]`` of ``rollout`` under ``model`` (no grad), in the batch's dtype."""
        return self.batch_logprobs(model, rollout, with_entropy=True, dtype=rollout.response_mask.dtype)

    def op_forward(self, batch: TrainBatch, processors: list[str]) -> dict[str, torch.Tensor]:
        needs = set().union(*(registry.processor_needs(name) for name in processors))  # unknown names fail here
        rollout = self._with_reference(self._rollout_batch(batch), "ref_logprobs" in needs)
        self.check_first_batch(rollout)
        return self._processed(processors, rollout, *self._logprobs_of(self.model, rollout))

    @staticmethod
    def _processed(processors: list[str], rollout, logprobs: torch.Tensor, entropy: torch.Tensor) -> dict[str, torch.Tensor]:
        """The outputs of ``processors`` (registered post-forward processors, by name) over ``rollout``'s log-probs."""
        ctx = registry.ForwardContext(logprobs=logprobs, entropy=entropy, mask=rollout.response_mask,
                                      response_ids=rollout.response_ids, ref_logprobs=rollout.ref_logprobs)
        out: dict[str, torch.Tensor] = {}
        for name in processors:
            out.update({key: value.detach().cpu() for key, value in registry.run_processor(name, ctx).items()})
        return out

    def op_forward_backward(self, batch: TrainBatch, loss: str, loss_config: dict[str, Any],
                            processors: list[str] = ()) -> dict[str, Any]:
        needs = registry.loss_needs(loss, loss_config)  # bad names and config keys fail here, before any work
        needs |= set().union(*(registry.processor_needs(name) for name in processors))
        if batch.advantages is None:
            raise RequestError("batch.advantages is required by forward_backward")
        if processors and self.sequence_parallel is not None:  # its pieces are the group's union, not this batch's
            raise RequestError("forward_backward's processors with model.compute.sequence_parallel > 1 are not supported;"
                               " call forward for them")
        rollout = self._with_reference(self._rollout_batch(batch), "ref_logprobs" in needs)
        self.check_first_batch(rollout)
        normalizer = LossNormalizer.of(rollout.response_mask, self.max_response_length, all_ranks=self.trainer.world_size > 1)

        sent_sampler = batch.sampler_logprobs is not None  # else the rollout batch holds zeros in their place
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # each piece's log-probs and entropies, for ``processors``

        def policy_loss(inputs: registry.LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            if processors:
                seen.append((inputs.logprobs.detach(), inputs.entropy.detach()))
            # inputs.weights: GRPOModule's own corrections, off in the service (a request asks for them in loss_config)
            return registry.compute_loss(loss, replace(inputs, weights=None, sampler_logprobs=inputs.sampler_logprobs
                                                       if sent_sampler else None), loss_config)

        plan = self.micro_batch_plan(rollout)
        pieces = len(plan)  # a failing first piece stops before its backward
        saved = self._gradients() if pieces > 1 and self._is_plain_torch() else None
        try:
            total, stats = self.backward_batch(rollout, normalizer, lambda piece, norm: self.micro_batch_loss(
                piece, norm, policy_loss, want_entropy=True))
        except FloatingPointError:
            why = f"the loss is not finite for this batch; inputs this large overflow float32: {batch.overflow_suspects()}"
            if pieces > 1 and saved is None:  # DeepSpeed's gradient buffers cannot be put back
                raise ServiceError(f"{why}; earlier micro-batches of this call were accumulated: call zero_grad") from None
            if saved is not None:
                self._restore_gradients(saved)
            raise RequestError(f"{why}; gradients left as they were before this call") from None
        out: dict[str, Any] = {"loss": total, **stats, "num_sequences": float(rollout.num_sequences),
                               "num_tokens": float(normalizer.num_tokens)}
        if processors:  # the loss's own forward, no second pass: each piece's rows put back in the batch's order
            logprobs, entropy = (torch.zeros_like(rollout.response_mask) for _ in range(2))
            for rows, (piece_logprobs, piece_entropy) in zip(plan, seen):
                if rows:  # a padding pass (a rank short of rows) holds none of the batch's
                    logprobs[rows], entropy[rows] = piece_logprobs.to(logprobs.dtype), piece_entropy.to(entropy.dtype)
            out["outputs"] = self._processed(processors, rollout, logprobs, entropy)
        return out

    def op_optim_step(self, lr: float | None = None, advance_schedule: bool = True, adam: AdamSettings | None = None) -> dict[str, float]:
        self._engines_needed(False)
        clip = None
        if adam is not None:
            configured = float(self.options.optim.max_grad_norm or 0.0)
            if not self._is_plain_torch() and adam.max_grad_norm != configured:  # DeepSpeed clips inside its step
                raise RequestError(f"optim_step: max_grad_norm={adam.max_grad_norm:g} differs from optim.max_grad_norm="
                                   f"{configured:g}, which DeepSpeed (training.zero_stage: {self._zero_stage()}) applies in"
                                   " its step; set optim.max_grad_norm to the request's")
            for group in self.optimizers().param_groups:  # under ZeRO: the groups of the torch AdamW it wraps
                group.update(betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay)
            clip = adam.max_grad_norm
        # lr: this step only; the scheduler sets the next step's as usual. A non-finite gradient's step is skipped
        grad_norm, used, skipped = self.apply_gradients(lr, advance_schedule, clip)
        self.optimizers().zero_grad()
        return {"grad_norm": grad_norm, "lr": float(used), "step": self.global_step, "step_skipped": skipped}

    def op_zero_grad(self) -> dict[str, Any]:
        self.optimizers().zero_grad()
        return {"step": self.global_step}

    def op_sync_weights(self) -> dict[str, float]:
        from arctic_rl.weight_sync.coordinator import EngineNotResponding

        try:
            report = self.engines.host.sync(self)  # woken first: weights must land in an awake engine
        except EngineNotResponding as e:  # a replica died or hangs: the weight-sync group is broken, the job ends
            raise JobFailed(str(e)) from e
        return {"seconds": report.seconds, "bytes": float(report.bytes), "num_tensors": float(report.num_tensors),
                "weight_version": self.engines.host.weight_sync.version}

    def op_sleep(self) -> dict[str, Any]:
        self.engines.host.sleep()
        return {}

    def op_wake(self) -> dict[str, Any]:
        self.engines.host.wake()
        return {}

    def op_save_state(self, path: Path, shown: str) -> dict[str, Any]:
        """Weights, optimizer, schedule and step into the folder ``path`` (checked by ``targets.check_target``)."""
        path.mkdir(parents=True, exist_ok=True)
        self.trainer.save_checkpoint(path / targets.STATE_FILE)  # every rank its own shards (a collective)
        if self.trainer.is_global_zero:
            targets.write_manifest(path, "state", zero_stage=self._zero_stage(), step=self.global_step,
                                   world_size=self.trainer.world_size, lora_rank=self.lora_options.rank)
        return {"path": shown, "step": self.global_step}

    def op_load_state(self, path: Path, shown: str) -> dict[str, Any]:
        """Restore a ``save_state`` folder. Every file is read with ``weights_only=True`` (nothing pickled runs),
        first all of them before anything is restored, so a refused state leaves the job as it was."""
        checkpoint = path / targets.STATE_FILE
        try:
            from arctic_rl.strategies.safe_load import check_loadable  # imports DeepSpeed: only here

            check_loadable(checkpoint)
        except pickle.UnpicklingError as e:
            raise RequestError(f"path {shown!r} is not a state the service wrote: {e}") from None
        restore_checkpoint(self.trainer, checkpoint)  # Lightning's own restore, as --ckpt_path uses it
        self.op_sync_weights()  # the engines sample from the restored weights
        return {"path": shown, "step": self.global_step}

    def op_export(self, path: Path, shown: str) -> dict[str, Any]:
        writer = self.trainer.is_global_zero  # under ZeRO-3 every rank takes part in gathering; rank 0 writes
        self.save_policy(path if writer else None)
        if writer:
            targets.write_manifest(path, "export", step=self.global_step)
        return {"path": shown, "step": self.global_step}

    def _zero_stage(self) -> int:
        """The ZeRO stage the job trains with (0: plain torch)."""
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = self.trainer.strategy
        return int(strategy.config["zero_optimization"]["stage"]) if isinstance(strategy, DeepSpeedStrategy) else 0

    def op_status(self) -> dict[str, Any]:
        return {"step": self.global_step, "lr": float(self.optimizers().param_groups[0]["lr"]),
                "model_type": self.model.config.model_type, "vocab_size": self.model.config.get_text_config().vocab_size,
                "eos_token_id": self.tokenizer.eos_token_id,
                "world_size": self.trainer.world_size, "rank": self.global_rank,
                "num_parameters": sum(p.numel() for p in self.model.parameters()), "pid": os.getpid(),
                "engine_replicas": self._replicas()}

    def _replicas(self) -> list[dict[str, Any]]:
        """Rank 0's engine replicas as ``op_status`` shows them: each one's weight version and place."""
        if not self.trainer.is_global_zero or self.engines is None:
            return []
        from arctic_rl.rollout.engines.ray.pool import ReplicaFailed

        try:
            return [{"replica": i, **place} for i, place in enumerate(self.engines.host.replicas())]
        except ReplicaFailed as e:
            raise JobFailed(str(e)) from e

    # ------------------------------------------------------------------ gradients (restored on a refused call)
    def _is_plain_torch(self) -> bool:
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return not isinstance(self.trainer.strategy, DeepSpeedStrategy)

    def _gradients(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]

    def _restore_gradients(self, saved: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.model.parameters(), saved):
            p.grad = g

