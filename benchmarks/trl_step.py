"""A TRL GRPO training step, TRL's own ``GRPOTrainer`` vs. ``ArcticGRPOTrainer`` (ZoRRo log-probs, arctic-rl's
loss), in one process, on the same random weights and the same fixed rollouts.

Both sides run TRL's ``trainer.train()`` loop unchanged except for generation: a benchmark-only mixin
returns a fixed batch from ``_generate_and_score_completions`` (``prompts`` distinct random prompts, each
with ``G`` random completions, advantages ~ N(0, 1)), so what is timed is TRL's step: its input
buffering, ``compute_loss`` (log-probs + loss), backward, gradient clipping and the AdamW step. Step time
is wall clock between ``on_step_begin`` and ``on_step_end`` (CUDA synchronised), median after warm-up
(the first steps compile FlexAttention). Qwen3-1.7B shape, bf16 weights, gradient checkpointing
(non-reentrant) on both sides, ``loss_type=dapo``, ``beta=0``.

    python3 benchmarks/trl_step.py --out trl_step.json              # H200: 2x8, 4096/512 (~3 min)
    python3 benchmarks/trl_step.py --backends flex,cudnn            # one TRL side, one arctic side per backend
    python3 benchmarks/trl_step.py --tiny                           # CPU smoke run (tiny model, 2x4, 64/32)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time

import torch
import trl
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from arctic_rl.integrations.trl import ArcticGRPOTrainer
from arctic_rl.tasks.toy import build_tokenizer

SHAPES = {  # as benchmarks/zorro_train.py
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000),
}


class FixedRollouts:
    """Benchmark-only: TRL's generation and scoring replaced by one fixed batch (``fixed``)."""

    fixed: dict

    def _generate_and_score_completions(self, inputs):
        return dict(self.fixed)


class TrlSide(FixedRollouts, GRPOTrainer):
    pass


class ArcticSide(FixedRollouts, ArcticGRPOTrainer):
    pass


class StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step, the device synchronised at both ends."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.seconds.append(time.perf_counter() - self._start)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fixed_batch(prompts: int, g: int, p: int, r: int, vocab: int, device: str) -> dict:
    """``prompts`` random prompts of ``p`` tokens, each repeated ``g`` times (TRL's group layout), random
    ``r``-token completions with no padding, advantages ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (prompts, p), generator=gen).repeat_interleave(g, 0)
    completion_ids = torch.randint(3, vocab, (prompts * g, r), generator=gen)
    batch = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                 completion_mask=torch.ones_like(completion_ids), advantages=torch.randn(prompts * g, generator=gen),
                 num_items_in_batch=torch.tensor(float(prompts * g * r)))
    return {k: v.to(device) for k, v in batch.items()}


def run_side(side: type, args: argparse.Namespace, batch: dict, out_dir: str, **side_kwargs) -> dict:
    """``args.warmup + args.iters`` TRL steps of ``side`` (built with ``side_kwargs``); its step times,
    peak memory and logs."""
    config = Qwen3Config(**SHAPES[args.shape], tie_word_embeddings=True, max_position_embeddings=65536, rope_theta=1e6)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = Qwen3ForCausalLM(config).to(args.device, dtype)
    n = batch["prompt_ids"].shape[0]
    grpo_args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=n, num_generations=args.g, max_completion_length=args.r,
        max_steps=args.warmup + args.iters, learning_rate=1e-6, loss_type="dapo", beta=0.0, logging_steps=1,
        gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=args.device == "cuda", use_cpu=args.device == "cpu", report_to=[], save_strategy="no", disable_tqdm=True, seed=0,
    )
    timer = StepTimer()
    dataset = Dataset.from_list([{"prompt": f"prompt {i}"} for i in range(args.prompts * (args.warmup + args.iters))])
    trainer = side(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=grpo_args,
                   train_dataset=dataset, processing_class=build_tokenizer(), callbacks=[timer], **side_kwargs)
    trainer.fixed = batch
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = dict(
        step_s=statistics.median(timer.seconds[args.warmup:]), steps_s=timer.seconds,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None,
        loss=[h["loss"] for h in logs], grad_norm=[h["grad_norm"] for h in logs],
        dedup_ratio=logs[0].get("zorro/dedup_ratio"),
    )
    del trainer, model
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--g", type=int, default=8)
    parser.add_argument("--p", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--r", type=int, default=512, help="completion tokens")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--backends", default="auto", help="ZoRRo attention backends, comma-separated (auto: flex on GPU)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 2x4, 64/32")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.shape, args.device = ("tiny", "cpu") if args.tiny else ("1.7b", "cuda")
    if args.tiny:
        args.g, args.p, args.r = 4, 64, 32
    batch = fixed_batch(args.prompts, args.g, args.p, args.r, SHAPES[args.shape]["vocab_size"], args.device)
    with tempfile.TemporaryDirectory() as out_dir:
        sides = {"trl": run_side(TrlSide, args, batch, out_dir)}
        for backend in args.backends.split(","):
            sides[f"arctic_{backend}"] = run_side(ArcticSide, args, batch, out_dir, attention_backend=backend)
    base = sides["trl"]
    for name, side in sides.items():  # against TRL's side: speed, and the same losses / gradient norms
        side["speedup"] = base["step_s"] / side["step_s"]
        side["max_loss_gap"] = max(abs(a - b) for a, b in zip(side["loss"], base["loss"]))
        side["max_grad_norm_rel_gap"] = max(abs(a - b) / b for a, b in zip(side["grad_norm"], base["grad_norm"]))
        print(f"| {args.prompts}x{args.g}, {args.p}/{args.r} | {name} | {side['step_s']:.3f} s | {side['speedup']:.2f}x | "
              f"peak GiB {side['peak_gib']} | dedup {side['dedup_ratio']} | loss gap {side['max_loss_gap']:.2e} | "
              f"grad-norm gap {side['max_grad_norm_rel_gap']:.2e} |")
    report = dict(
        date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        torch=torch.__version__, trl=trl.__version__, shape=args.shape, case=[args.prompts, args.g, args.p, args.r],
        sides=sides,
    )
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
