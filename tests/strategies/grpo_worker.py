"""One rank of a small GRPO training run, for tests/strategies (run by the tests as a process of its own per rank, forked
from one that imported its dependencies: ``tests/rank_forks.py``; or as a script, as below).

    python tests/strategies/grpo_worker.py --task DIR --model DIR --out DIR --strategy zero3 --steps 4

It trains ``EchoDigitGRPO`` with a real Trainer and, for ``zero1``/``zero2``/``zero3``, a real
``ArcticStrategy`` (DeepSpeed on CPU over gloo); the rank and world size come from the usual
``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` variables, set by the test. Rollouts are scripted
(``ScriptedRollouts``): random responses and rewards that depend only on (step, position in the global
batch), built for the whole global batch on every rank (the ranks' prompts are all-gathered) and
sliced per rank, so runs with different world sizes train on exactly the same global batch. It writes into ``--out``:

- ``metrics.jsonl`` (rank 0): per optimizer step the global loss (as logged: the ranks' shares summed), grad norm, lr
  (and, with ``--micro-batch-tokens``, the ranks' token imbalance before and after balancing);
- ``rng.jsonl`` (rank 0): the next Python ``random`` draw when each checkpoint is written and when
  training starts (after a resume has restored its state);
- ``gathered.pt`` (rank 0): every ``named_parameters_for_sync`` tensor at the end, and the peak bytes
  of full parameters gathered at once while iterating it (``peak_gathered_bytes``); the reference
  model's parameters (``ref_tensors``; with ``--sync-ref-model-steps`` mixed with the policy, TRL's ``sync_ref_model``);
- ``export_rank{r}/``: ``save_policy`` at the end;
- with ``--lora-rank``: ``model_state_start.pt`` / ``model_state_end.pt`` (rank 0): the policy's whole state dict
  (base and adapters) when training starts (after a resume has restored it) and at the end.

``--kill-in-save-at-step S`` SIGKILLs every rank in the middle of writing the step-S checkpoint (after
the model states, before the optimizer states), as a crash would.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from arctic_rl.data.prompts import PROMPT_IDS, PromptDataModule
from arctic_rl.modules.ref_sync import ref_sync_callbacks
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.rollout.callback import RolloutCallback
from arctic_rl.strategies import ArcticStrategy
from arctic_rl.strategies.zero import full_nbytes, gather_in_buckets, is_partitioned
from arctic_rl.modules.lora import LoraOptions
from arctic_rl.modules.losses import Regularizers
from arctic_rl.modules.options import ComputeOptions, OptimOptions, RefSyncOptions, SamplingOptions
from arctic_rl.tasks.toy import EchoDigitGRPO

GROUP_SIZE = 4
RESPONSE_LENGTH = 6


def scripted_rollout(module, prompts: list[list[int]], step: int) -> RolloutBatch:
    """G random responses per prompt and random rewards, a function of (step, position) only."""
    g = GROUP_SIZE
    prompt_ids = [ids for ids in prompts for _ in range(g)]
    n = len(prompt_ids)
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(1, RESPONSE_LENGTH + 1, (n,), generator=gen)
    response_ids = torch.randint(9, 33, (n, RESPONSE_LENGTH), generator=gen)  # digits and filler words
    mask = (torch.arange(RESPONSE_LENGTH)[None] < lengths[:, None]).float()
    response_ids = torch.where(mask.bool(), response_ids, module.tokenizer.pad_token_id)
    rewards = torch.rand(n, generator=gen)
    return RolloutBatch(
        prompt_token_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=mask,
        sampler_logprobs=torch.zeros(n, RESPONSE_LENGTH),
        rewards=rewards,
        advantages=module.compute_advantages(rewards, g),
        group_size=g,
        prompts=[""] * n,
        completions=[""] * n,
    )


class ScriptedRollouts(RolloutCallback):
    """Deterministic rollouts in place of an engine: this test is about the trainer, not generation."""

    def __init__(self, out: Path) -> None:
        super().__init__(engine="transformers")
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:  # no engine; after a resume has restored everything
        self._record_rng(trainer, "train_start")
        if pl_module.lora_options.enabled:
            save_model_state(trainer, pl_module, self.out / "model_state_start.pt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:  # just before the strategy writes
        self._record_rng(trainer, "save")

    def _record_rng(self, trainer, event: str) -> None:
        if trainer.is_global_zero:
            with open(self.out / "rng.jsonl", "a") as f:
                probe = random.Random()
                probe.setstate(random.getstate())  # the next draw, without consuming it
                f.write(json.dumps({"event": event, "step": trainer.global_step, "next_random": probe.random()}) + "\n")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step, g, world, rank = trainer.global_step, GROUP_SIZE, trainer.world_size, trainer.global_rank
        random.random()  # user code (a reward function) drawing from Python's RNG: its state must resume
        # the prompt sampler gives rank r the rows r, r + W, r + 2W, ... of the shuffled order, so
        # interleaving the ranks' batches gives the single-process batch, in its order
        per_rank = [batch[PROMPT_IDS]] * world
        if world > 1:
            torch.distributed.all_gather_object(per_rank, batch[PROMPT_IDS])
        local = len(batch[PROMPT_IDS])
        global_prompts = [per_rank[r][j] for j in range(local) for r in range(world)]
        full = scripted_rollout(pl_module, global_prompts, step)
        rows = [(j * world + rank) * g + k for j in range(local) for k in range(g)]  # this rank's groups
        batch["rollout"] = full.take(rows)
        batch["rollout_metrics"] = {"reward/mean": full.rewards.mean().item(), "timing/rollout_s": 0.0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.callback_metrics["loss"]  # the step's global loss (log_step sums the ranks' shares)
        if trainer.is_global_zero:
            row = {
                "step": trainer.global_step,
                "loss": loss.item(),
                "grad_norm": trainer.callback_metrics["grad_norm"].item(),
                "lr": trainer.callback_metrics["lr"].item(),
            }
            for key in ("zorro/rank_tokens_max_over_mean_before", "zorro/rank_tokens_max_over_mean",
                        "self_check/max_gap/zorro_auto", "self_check/max_gap/naive"):
                if key in trainer.callback_metrics:
                    row[key] = trainer.callback_metrics[key].item()
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


class WorkerGRPO(EchoDigitGRPO):
    def configure_callbacks(self) -> list[pl.Callback]:
        # no RunSummary (its print adds nothing to these runs) and no default RolloutCallback: rollouts are scripted
        return ref_sync_callbacks(self.options.ref_sync)


def save_model_state(trainer, module, path: Path) -> None:
    """The policy's whole state dict (LoRA runs: ZeRO-1/2 only, parameters not partitioned), on rank 0."""
    if trainer.is_global_zero:
        torch.save({n: t.detach().clone() for n, t in module.model.state_dict().items()}, path)


def gather_and_measure(module, bucket_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    """All ``named_parameters_for_sync`` tensors (cloned) and the peak bytes of full parameters that
    were gathered at the same time while iterating."""
    params = list(module.model.parameters())
    tensors, peak = {}, 0
    for name, tensor in module.named_parameters_for_sync(bucket_bytes):
        gathered = sum(full_nbytes(p) for p in params if is_partitioned(p) and p.numel() == p.ds_numel)
        peak = max(peak, gathered)
        tensors[name] = tensor.clone()
    return tensors, peak


def kill_when_saving_optimizer_states(trainer: pl.Trainer, step: int) -> None:
    """SIGKILL this rank inside DeepSpeed's save of the step-``step`` checkpoint, between its files."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._save_zero_checkpoint

    def save_or_die(engine, *args, **kwargs):
        if trainer.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(engine, *args, **kwargs)

    DeepSpeedEngine._save_zero_checkpoint = save_or_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategy", choices=["auto", "zero1", "zero2", "zero3"], default="auto")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="global batch of prompts")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep every checkpoint, not only last.ckpt")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA adapters of this rank (alpha 2 x rank)")
    parser.add_argument("--kill-in-save-at-step", type=int, default=0)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--kl-coef", type=float, default=0.0, help="> 0 adds the frozen reference model")
    parser.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per rollout batch")
    parser.add_argument("--sync-ref-model-steps", type=int, default=0, help="> 0: TRL's sync_ref_model every this many steps")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="ZoRRo token budget per forward (instead of 4 sequences), groups balanced over ranks")
    parser.add_argument("--sequence-parallel", type=int, default=1, help="compute.sequence_parallel (ranks per packed row)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    pl.seed_everything(0, verbose=False)
    if args.strategy == "auto":
        strategy = "auto"
    else:
        stage = int(args.strategy[-1])
        strategy = ArcticStrategy(stage=stage, config={"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else None)
    module = WorkerGRPO(
        model=args.model,
        tokenizer=args.model,
        sampling=SamplingOptions(group_size=GROUP_SIZE, max_prompt_length=32, max_response_length=RESPONSE_LENGTH),
        optim=OptimOptions(learning_rate=1e-3, lr_schedule="linear", warmup_steps=2, mini_batches=args.mini_batches,
                           max_grad_norm=0.5),  # binding at these sizes: clipping is part of what must match
        compute=ComputeOptions(micro_batch_size=None if args.micro_batch_tokens else 4,  # several backward passes per step on every rank
                               micro_batch_tokens=args.micro_batch_tokens, sequence_parallel=args.sequence_parallel),
        regularizers=Regularizers(kl_coef=args.kl_coef),
        ref_sync=RefSyncOptions(sync_ref_model=args.sync_ref_model_steps > 0, ref_model_sync_steps=max(args.sync_ref_model_steps, 1),
                                ref_model_mixup_alpha=0.5),
        lora=LoraOptions(rank=args.lora_rank, alpha=2.0 * args.lora_rank if args.lora_rank else None),
    )
    data = PromptDataModule(train_path=str(Path(args.task) / "train.jsonl"), batch_size=args.prompts // world_size, seed=0)
    callbacks: list[pl.Callback] = [ScriptedRollouts(out)]
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=args.checkpoint_every, save_last=True,
                                         save_top_k=-1 if args.keep_checkpoints else 0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=args.steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the prompt sampler shards by rank itself
        default_root_dir=out,
        callbacks=callbacks,
        enable_checkpointing=bool(args.checkpoint_every),
    )
    if args.kill_in_save_at_step:
        kill_when_saving_optimizer_states(trainer, args.kill_in_save_at_step)
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)

    tensors, peak = gather_and_measure(module, args.bucket_bytes)
    ref = {} if module.ref_model is None else {n: t.clone() for n, t in gather_in_buckets(list(module.ref_model.named_parameters()), args.bucket_bytes)}
    if trainer.is_global_zero:
        torch.save({"tensors": tensors, "peak_gathered_bytes": peak, "bucket_bytes": args.bucket_bytes, "ref_tensors": ref}, out / "gathered.pt")
    if args.lora_rank:
        save_model_state(trainer, module, out / "model_state_end.pt")
    module.save_policy(str(out / f"export_rank{trainer.global_rank}"))
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()
    # end as Python would (the atexit handlers, flushed output) without its teardown of every module imported,
    # seconds of CPU for each rank
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
