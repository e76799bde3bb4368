"""One rank of a ``Trainer.fit`` run that replays a service client loop's batches (run by
``tests/serve/test_ranks.py`` as 2 real processes through ``tests/strategies/conftest.launch``).

    python tests/serve/rank_fit_worker.py --config CONFIG.json --batches BATCHES.pt --out DIR

The module is ``GRPOModule`` with the option sections the service builds from the same client config
(``ArcticRLClientConfig.module_options()``: learning rate, warm-up, clipping, micro-batches) and the loss
the client loop asks for (``dapo``, no corrections); the strategy is ``ArcticStrategy`` at the config's
ZeRO stage, gloo on CPU. Each step's rollout batch is the client loop's ``TrainBatch`` (prompts, sampled
tokens, their log-probs, advantages), made into the trainer's ``RolloutBatch`` as the service does and
dealt over the ranks as fit deals prompts: whole groups, rank ``r`` taking groups ``r, r + W, ...``.
It writes into ``--out``: ``metrics.jsonl`` (rank 0; per step the global loss, as logged: the ranks' shares summed, and
the gradient norm) and ``export/`` (rank 0's ``save_policy`` at the end).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.modules.losses import LossConfig
from arctic_rl.rollout.callback import RolloutCallback
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.strategies import ArcticStrategy


class ReplayedRollouts(RolloutCallback):
    """The client loop's batches in place of an engine, one per step."""

    def __init__(self, batches: list[dict], group_size: int, out: Path) -> None:
        super().__init__(engine="transformers")
        self.batches, self.group_size, self.out = batches, group_size, out

    def on_train_start(self, trainer, pl_module) -> None:  # no engine to start
        pass

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        sent = self.batches[trainer.global_step]
        full = TrainBatch.build(sent["prompts"], sent["completions"], sent["advantages"],
                                sampler_logprobs=sent["sampler_logprobs"]).to_rollout_batch(pl_module.tokenizer.pad_token_id)
        world, rank, g = trainer.world_size, trainer.global_rank, self.group_size
        groups = full.num_sequences // g
        batch["rollout"] = full.take([grp * g + k for grp in range(rank, groups, world) for k in range(g)])
        batch["rollout_metrics"] = {"reward/mean": 0.0, "timing/rollout_s": 0.0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = trainer.callback_metrics["loss"]  # the batch's loss (log_step sums the ranks' shares)
        if trainer.is_global_zero:
            row = {"step": trainer.global_step - 1, "loss": loss.item(), "grad_norm": trainer.callback_metrics["grad_norm"].item()}
            with open(self.out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


class ReplayGRPO(GRPOModule):
    def reward(self, prompts, completions, **columns):  # never called: the rollouts carry their advantages
        raise AssertionError("replayed rollouts carry their advantages")

    def configure_callbacks(self) -> list[pl.Callback]:
        return []  # no default RolloutCallback: the rollouts are replayed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="the client config (JSON) the service loop ran with")
    parser.add_argument("--batches", required=True, help="torch file: the client loop's batches, a list of dicts")
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = ArcticRLClientConfig.load(json.loads(Path(args.config).read_text()))
    batches = torch.load(args.batches, weights_only=True)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    pl.seed_everything(config.sampling.seed, verbose=False)
    options = config.module_options()  # fit needs the group size the service's requests brought
    sampling = dataclasses.replace(options["sampling"], group_size=args.group_size)
    module = ReplayGRPO(model=config.model, tokenizer=config.tokenizer, dtype=config.dtype,
                        **{**options, "sampling": sampling, "loss": LossConfig(loss_type="dapo")})
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=ArcticStrategy(stage=config.training.zero_stage),
        max_steps=len(batches), logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, use_distributed_sampler=False, default_root_dir=out,
        callbacks=[ReplayedRollouts(batches, args.group_size, out)],
    )
    steps = DataLoader(range(len(batches)), batch_size=1, collate_fn=lambda items: {})
    trainer.fit(module, train_dataloaders=steps)
    module.save_policy(str(out / "export") if trainer.is_global_zero else None)
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()
    # end as Python would (the atexit handlers, flushed output) without its teardown of every module imported,
    # seconds of CPU for each rank
    atexit._run_exitfuncs()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
