"""``TrainingCore``: the training operations of ``GRPOModule``, each written once, public, with its contract.
``GRPOModule.training_step`` and every operation of the backend service (``serve/service_module.py``) are
sequences of these calls:

- log-probs: :meth:`sequence_logprobs` (one forward, with grad) and :meth:`batch_logprobs` (no grad, in micro-batches);
- backward: :meth:`backward_batch` over a batch in micro-batches, each piece's loss from :meth:`micro_batch_loss`
  with the module's :meth:`policy_loss` or a named one the caller passes;
- one optimizer step: :meth:`apply_gradients` (clip, step, schedule; a non-finite gradient's step skipped).

With ``compute.sequence_parallel`` N > 1 the log-prob passes are collectives of N consecutive ranks
(:attr:`sequence_parallel`): :meth:`batch_logprobs` and :meth:`backward_batch` gather the group's shares, compute
their union (every rank a 1/N slice of each packed row, ``arctic_rl/zorro/sequence_parallel.py``) and hand each rank
its own rows back. Callers keep passing their own share and normalising over all ranks, as with data parallelism.

A mixin of ``GRPOModule`` (it reads the module's ``options``, ``model``, ``tokenizer``, ``trainer`` and hooks).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.losses import LossInputs, LossNormalizer, masked_mean
from arctic_rl.modules.micro_batches import micro_batch_rows, pad_across_ranks
from arctic_rl.modules.models import response_logprobs
from arctic_rl.modules.step_metrics import accumulate, is_extreme
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.router_replay import RoutedTokens
from arctic_rl.zorro.sequence_parallel import SequenceParallel

logger = logging.getLogger(__name__)
MicroBatchLoss = Callable[[RolloutBatch, LossNormalizer], tuple[torch.Tensor, dict[str, Any]]]


class TrainingCore:
    """Log-probs, backward and optimizer step of a ``GRPOModule`` (see the module docstring)."""

    def sequence_logprobs(
        self, model: torch.nn.Module, batch: RolloutBatch, with_entropy: bool = False, routed: RoutedTokens | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Response-token log-probs ``[n, R]`` (and entropies) of ``batch`` under ``model`` in one forward, with
        grad where autograd is on: ZoRRo's deduplicated pass (shared prompts, or the prefix tree with
        ``zorro_dedup="tree"``), or the naive per-sequence batch with ``zorro=False``.

        Args:
            model: the policy or the reference model.
            batch: the sequences, all in one forward (see :meth:`micro_batch_plan` for bounded memory).
            with_entropy: also return the per-token entropies ``[n, R]``; None otherwise.
            routed: router replay (:meth:`routed_tokens`): the forward routes every token to its recorded experts.

        Under ``compute.sequence_parallel`` a collective of the group: its ranks pass the same ``batch``.
        """
        # the forward runs over every response token (sequence_mask: generated and, multi-turn, the environment's);
        # the environment's tokens then read 0, as padding does: only generated tokens have log-probs
        args = (model, batch.prompt_token_ids, batch.response_ids, batch.sequence_mask, self.options.sampling.temperature,
                with_entropy, self.tokenizer.pad_token_id)
        if self.options.compute.zorro:
            from arctic_rl.zorro import zorro_response_logprobs

            logprobs, entropy = zorro_response_logprobs(*args, attention_backend=self.options.compute.attention_backend,
                                                        dedup=self.options.compute.zorro_dedup, routed=routed,
                                                        sequence_parallel=self.sequence_parallel)
        else:
            logprobs, entropy = response_logprobs(*args, routed=routed)
        if batch.observation_mask is None:
            return logprobs, entropy
        return logprobs * batch.response_mask, None if entropy is None else entropy * batch.response_mask

    def routed_tokens(self, model: torch.nn.Module, batch: RolloutBatch) -> RoutedTokens | None:
        """Router replay's source for a forward of ``model`` over ``batch``: the batch's recorded routing when
        ``corrections.router_replay`` is on and ``model`` is the policy (whose routers are hooked), else None. A batch
        without ``routed_experts`` then raises ``ValueError``."""
        if not self.options.corrections.router_replay or model is not self.model:
            return None
        if batch.routed_experts is None:
            raise ValueError("model.corrections.router_replay: the batch carries no routed_experts (the rollout engine records"
                             " them; a batch from elsewhere has none)")
        return RoutedTokens(batch.routed_experts)

    @functools.cached_property
    def sequence_parallel(self) -> SequenceParallel | None:
        """This rank's Ulysses group (``compute.sequence_parallel`` consecutive ranks), or None when that is 1. Built
        on first use by every rank together (``setup`` does it first); ``ConfigError`` when it does not divide the world."""
        degree = self.options.compute.sequence_parallel
        if degree == 1:
            return None
        world = self.trainer.world_size
        if world % degree:
            raise ConfigError(f"model.compute.sequence_parallel={degree} must divide the number of training ranks ({world}): "
                              f"the ranks form world/{degree} sequence-parallel groups")
        return SequenceParallel.consecutive_groups(degree)

    def sequence_parallel_union(self, batch: RolloutBatch) -> tuple[RolloutBatch, list[int]]:
        """The union of the sequence-parallel group's ``batch`` shares (rank order; every rank of the group calls it)
        and the rows of this rank's share in it; ``(batch, all its rows)`` without sequence parallelism."""
        sp = self.sequence_parallel
        if sp is None:
            return batch, list(range(batch.num_sequences))
        shares: list[RolloutBatch | None] = [None] * sp.size
        torch.distributed.all_gather_object(shares, batch.to("cpu"), group=sp.group)
        start = sum(share.num_sequences for share in shares[: sp.rank])
        return RolloutBatch.concat(shares).to(batch.response_ids.device), list(range(start, start + batch.num_sequences))

    def micro_batch_plan(self, batch: RolloutBatch) -> list[list[int]]:
        """Row indices of each forward/backward over ``batch``; every rank gets as many (ZeRO-3's
        gathers are collectives), a rank short of work repeating row 0 as a zero-weight pass."""
        plan = micro_batch_rows(batch, self.micro_batch_size, self.micro_batch_tokens)  # micro_batches.py
        return pad_across_ranks(plan, self.device) if self.trainer.world_size > 1 else plan

    @torch.no_grad()
    def batch_logprobs(
        self, model: torch.nn.Module, batch: RolloutBatch, with_entropy: bool = False, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies ``[n, R]`` of the whole of ``batch`` under ``model``, without grad, a
        micro-batch (:meth:`micro_batch_plan`) at a time. A collective under ZeRO-3: every rank must call it.

        Args:
            model: the policy (old-policy log-probs, entropies) or the reference model.
            batch: any number of sequences.
            with_entropy: compute the entropies; zeros in their place otherwise.
            dtype: the dtype of both results; None: the log-probs' own (float64 for a float64 policy).
        """
        share, (batch, mine) = batch, self.sequence_parallel_union(batch)
        out: list[torch.Tensor] = []
        for rows in self.micro_batch_plan(batch):
            piece = batch.take(rows or [0])
            values = self.sequence_logprobs(model, piece, with_entropy, self.routed_tokens(model, piece))
            out = out or [torch.zeros(batch.response_mask.shape, dtype=dtype or values[0].dtype, device=values[0].device)
                          for _ in range(2)]
            for target, value in [(t, v) for t, v in zip(out, values) if rows and v is not None]:  # a padding pass: nothing
                target[rows] = value.to(target.dtype)
        if not out:  # no sequence at all
            out = [torch.zeros_like(batch.response_mask, dtype=dtype) for _ in range(2)]
        if share is batch:
            return out[0], out[1]
        width = share.response_ids.shape[1]  # the union is padded to its longest response
        return out[0][mine, :width], out[1][mine, :width]

    def micro_batch_loss(
        self, piece: RolloutBatch, normalizer: LossNormalizer,
        policy_loss: Callable[[LossInputs], tuple[torch.Tensor, dict[str, Any]]] | None = None, want_entropy: bool | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch ``piece`` of a mini-batch: its log-probs with grad, then ``policy_loss``.

        Args:
            piece: the micro-batch; ``piece.old_logprobs`` None means on-policy (the current log-probs, detached).
            normalizer: the whole mini-batch's counts, so the pieces' losses sum to the mini-batch's.
            policy_loss: a function of one ``LossInputs``, as :meth:`policy_loss` (default: that hook), e.g. a loss
                the service looked up by name.
            want_entropy: pass the entropies to ``policy_loss`` (default: when the loss needs them, as
                ``entropy_coef > 0`` makes the built-ins).

        Returns:
            ``(loss, stats)``: ``policy_loss``'s, plus ``entropy`` and ``sampler_logprob_diff`` (token means), and with
            router replay ``router/mismatch`` and ``router/mismatch_tokens`` (``router_replay.RoutedTokens.metrics``).
        """
        want_entropy = "entropy" in self.loss_inputs_needed if want_entropy is None else want_entropy
        routed = self.routed_tokens(self.model, piece)
        logprobs, entropy = self.sequence_logprobs(self.model, piece, with_entropy=True, routed=routed)
        old = piece.old_logprobs if piece.old_logprobs is not None else logprobs.detach()
        mask = self.loss_mask(piece)
        loss, stats = (policy_loss or self.policy_loss)(LossInputs(
            logprobs, old, piece.advantages, mask, normalizer, piece.ref_logprobs, entropy if want_entropy else None,
            weights=self.policy_weights(piece, logprobs, mask), sampler_logprobs=piece.sampler_logprobs,
        ))
        stats["entropy"] = masked_mean(entropy.detach(), mask)
        stats["sampler_logprob_diff"] = masked_mean((logprobs.detach() - piece.sampler_logprobs).abs(), piece.response_mask)
        if routed is not None:
            stats.update({k: torch.tensor(v) for k, v in routed.metrics().items()})
        return loss, stats

    def backward_batch(
        self, batch: RolloutBatch, normalizer: LossNormalizer, micro_batch_loss: MicroBatchLoss | None = None,
    ) -> tuple[float, dict[str, float]]:
        """Forward and backward over ``batch`` in micro-batches (``micro_batch_plan``), accumulating gradients;
        ``micro_batch_loss(piece, normalizer)`` (default: :meth:`micro_batch_loss`) gives each piece's loss.
        Returns the batch loss (the pieces' sum) and the stats averaged over pieces. A non-finite loss raises
        ``FloatingPointError`` before its backward.

        Under ``compute.sequence_parallel`` N the group's shares are computed together (:meth:`sequence_parallel_union`,
        ``normalizer`` counting every rank's share as usual); the returned loss is this rank's 1/N of the union's, so
        the ranks' losses still sum to the global batch's."""
        micro_batch_loss = micro_batch_loss or self.micro_batch_loss
        batch, _ = self.sequence_parallel_union(batch)
        group = 1 if self.sequence_parallel is None else self.sequence_parallel.size
        world_size, micro, sums, total = self.trainer.world_size, self.micro_batch_plan(batch), {}, 0.0
        for rows in micro:
            loss, stats = micro_batch_loss(batch.take(rows or [0]), normalizer)
            if not rows:  # padding pass, so every rank runs as many forwards: contributes nothing
                loss, stats = loss * 0.0, {k: v * 0.0 for k, v in stats.items() if not is_extreme(k)}
            if not torch.isfinite(loss):
                raise FloatingPointError(f"loss is {loss.item()} at step {self.global_step}; rewards {batch.rewards.tolist()}")
            # the strategies average gradients over ranks: scaled by world_size, the step's gradient is the global batch's.
            # A sequence-parallel group's N ranks each hold the union's loss and their gradients sum to N times its
            # gradient (sequence_parallel.py), so the group's share of the world's average is scaled by world_size / N
            self.manual_backward(loss * (world_size / group))
            total += loss.item() / group  # micro-batch losses sum to the batch loss
            accumulate(sums, stats, 1.0 / max(sum(1 for r in micro if r), 1))
        return total, sums

    def apply_gradients(self, lr: float | None = None, advance_schedule: bool = True,
                        max_grad_norm: float | None = None) -> tuple[float, float, bool]:
        """One optimizer step on the accumulated gradients: clip them to ``max_grad_norm`` (DeepSpeed clips inside
        its step), step the optimizer, advance the learning-rate schedule. Gradients are left for the caller to zero.

        A step whose global gradient norm is not finite is skipped (``strategies.arctic.guarded_step``): the weights
        and the optimizer state are untouched, the gradients cleared, a warning names the step; it still counts as a
        step (``global_step`` and the schedule advance), so a run resumes exactly as it ran.

        Args:
            lr: the learning rate of this step only (all parameter groups), finite and > 0 (else ``ValueError``);
                the schedule sets the next as usual. None: the schedule's.
            advance_schedule: False: leave the schedule where it is (the next step gets this step's scheduled rate).
            max_grad_norm: this step's clipping threshold (0: no clipping); None: ``options.optim.max_grad_norm``. Plain
                torch only: DeepSpeed clips inside its step to its configured value.

        Returns:
            ``(grad_norm, lr, skipped)``: the norm before clipping, the learning rate the step used, and whether
            the step was skipped for a non-finite gradient.
        """
        from arctic_rl.strategies.arctic import guarded_step  # DeepSpeed clips inside its step

        if lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        used = optimizer.param_groups[0]["lr"]
        if not math.isfinite(used):  # the schedule's: bounded by the configured rate, checked at start
            raise ValueError(f"the learning rate of step {self.global_step} is {used}")
        clip = self.options.optim.max_grad_norm if max_grad_norm is None else max_grad_norm
        step = self.global_step
        grad_norm, skipped = guarded_step(self.trainer.strategy, self.model, optimizer, clip)
        if skipped:
            logger.warning("step %d skipped: the gradient norm is %s (not finite); weights and optimizer state kept",
                           step, grad_norm)
        if advance_schedule:
            scheduler.step()
        elif lr is not None:  # the next step gets the schedule's rate again, not this step's override
            for group, base in zip(optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = base
        return grad_norm, used, skipped
