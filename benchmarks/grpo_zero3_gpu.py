"""GRPO training step under ArcticStrategy ZeRO-3 on one GPU: ZoRRo (FlexAttention) vs. the naive batch.

A real ``lightning.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed",
strategy=ArcticStrategy(stage=3))`` trains ``GRPOModule`` (Qwen3-1.7B shape from a config dict,
random weights, gradient checkpointing, torch AdamW wrapped by ZeRO) on scripted rollouts: fixed
random prompt / response token ids in the GRPO layout (``prompts x G`` sequences, the G samples of a
prompt contiguous and sharing its ids), all responses full length, random rewards per step (so the
advantages are nonzero). No rollout engine and no weight sync: only the trainer's step is timed.

Per side (``zorro`` = ``GRPOModule(zorro=True, attention_backend="flex")``, ``naive`` = ``zorro=False``),
each in its own process (a fresh DeepSpeed engine and CUDA allocator):

- step time: wall time of each training step (``torch.cuda.synchronize()`` at both ends), from
  ``on_train_batch_start`` (after the scripted rollout is in the batch) to ``on_train_batch_end``;
  median / mean over ``--steps`` steps after ``--warmup`` steps;
- tokens/s: naive prompt+response tokens (``N x (P + R)``) per second, deduplicated tokens
  (``prompts x (P + G x R)``) per second, and the tokens this side actually ran through the model per second;
- peak memory: ``torch.cuda.max_memory_allocated()`` over the measured steps (reset after warm-up),
  and the memory allocated after ZeRO-3 setup (partitioned bf16 weights, fp32 master + Adam states).

    python benchmarks/grpo_zero3_gpu.py --out grpo.json                                   # both sides, ~3 min on an H200
    python benchmarks/grpo_zero3_gpu.py --model tiny --prompt-len 64 --response-len 32 --warmup 1 --steps 1   # smoke
    python benchmarks/grpo_zero3_gpu.py --liger true --out grpo_liger.json                 # with Liger's kernels
    python benchmarks/grpo_zero3_gpu.py --stages 1,3 --profile --sides zorro --out stages.json   # ZeRO stages, profiled

``--stages``: the ZeRO stages to run (each side at each stage in its own process). ``--profile``: one extra step
after the measured ones under ``torch.profiler`` (CPU and CUDA): the ops with the most self CUDA time and the most
self CPU time, and the count of host synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
``aten::_local_scalar_dense``, ``aten::item``) in the step, written into the side's result; at stage 3 also how often
DeepSpeed's parameter trace was complete (prefetching) at a step's end, or being recorded or invalid (not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_BUILD_OPS", "0")

SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=151936),
}
LIGER = {"auto": "auto", "true": True, "false": False}  # --liger -> GRPOModule(liger=...)


def model_config(shape: str) -> dict:
    return {"model_type": "qwen3", **SHAPES[shape], "tie_word_embeddings": True,
            "max_position_embeddings": 65536, "rope_theta": 1e6}


def torch_optimizer(optimizer):
    """The torch optimizer inside DeepSpeed's / Lightning's wrappers."""
    while not hasattr(optimizer, "defaults") and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense", "aten::item")


def profile_summary(profiler, cuda: bool, rows: int = 25) -> dict:
    """The profiled step's top ops by self CUDA and self CPU time (ms, calls) and its host synchronisations."""
    events = profiler.key_averages()

    def top(key: str) -> list:
        ranked = sorted(events, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[:rows]
        return [[e.key, round((getattr(e, key, 0) or 0) / 1e3, 3), e.count] for e in ranked]

    return {"by_self_cuda_ms": top("self_device_time_total") if cuda else [], "by_self_cpu_ms": top("self_cpu_time_total"),
            "syncs": {e.key: e.count for e in events if e.key in SYNCS},
            "cuda_total_ms": round(sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e3, 2),
            "table": profiler.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows)}


def run_side(args: argparse.Namespace, side: str) -> dict:
    """One Trainer.fit of ``warmup + steps`` GRPO steps in this process; returns the measurements."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, Dataset

    from arctic_rl.modules.grpo import GRPOModule
    from arctic_rl.modules.options import ComputeOptions, OptimOptions, SamplingOptions
    from arctic_rl.liger import has_liger
    from arctic_rl.rollout.batch import RolloutBatch
    from arctic_rl.rollout.callback import RolloutCallback
    from arctic_rl.strategies import ArcticStrategy
    from arctic_rl.tasks.toy import build_tokenizer

    cuda = torch.cuda.is_available()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def gib(stat) -> float:
        return stat() / 2**30 if cuda else 0.0

    n_prompts, g, p, r = args.prompts, args.group, args.prompt_len, args.response_len
    n = n_prompts * g
    vocab = SHAPES[args.model]["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for _ in range(n_prompts)]
    prompt_ids = [prompts[i // g] for i in range(n)]
    response_ids = torch.randint(1, vocab, (n, r), generator=gen)
    response_mask = torch.ones(n, r)

    phases: dict[str, list[float]] = {"fwd_bwd_s": [], "optimizer_s": []}

    def phase_timer(name: str, fn):
        def wrapper(*a, **k):
            sync()
            started = time.perf_counter()
            out = fn(*a, **k)
            sync()
            phases[name].append(time.perf_counter() - started)
            return out
        return wrapper

    class Bench(GRPOModule):
        def reward(self, prompts, completions, **columns):  # never called: rollouts are scripted
            raise AssertionError("scripted rollouts")

        def backward_batch(self, *a, **k):  # forward + backward of all micro-batches (ZeRO-3 hooks included)
            return phase_timer("fwd_bwd_s", super().backward_batch)(*a, **k)

        def apply_gradients(self, *a, **k):  # clipping, the optimizer step (ZeRO's), the schedule
            return phase_timer("optimizer_s", super().apply_gradients)(*a, **k)

    class ScriptedRollouts(RolloutCallback):
        """Fixed token ids, random rewards per step; times each step and tracks peak memory."""

        def __init__(self) -> None:
            super().__init__(engine="transformers")
            self.times: list[float] = []
            self.train_s: list[float] = []
            self.losses: list[float] = []
            self.grad_norms: list[float] = []
            self.after_setup_gib = 0.0
            self.started = 0.0

        def on_train_start(self, trainer, pl_module) -> None:  # no engine
            # Workaround (arctic_rl bug, see BENCHMARKS.md): Lightning's DeepSpeedStrategy with ZeRO-3 never
            # moves the LightningModule to the GPU (DeepSpeed places only the partitioned parameters), so
            # GRPOModule's torchmetrics states (epoch_reward, epoch_accuracy) stay on CPU while training_step
            # puts the rollout's rewards on cuda, and epoch_reward.update fails. Setting _device alone did not
            # help on the H200 (the rollout was on cuda already); it is kept so that both agree.
            pl_module._device = trainer.strategy.root_device
            pl_module.epoch_reward.to(trainer.strategy.root_device)
            pl_module.epoch_accuracy.to(trainer.strategy.root_device)
            sync()
            self.after_setup_gib = gib(torch.cuda.memory_allocated)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            step = trainer.global_step
            rewards = torch.rand(n, generator=torch.Generator().manual_seed(1000 + step))
            batch["rollout"] = RolloutBatch(
                prompt_token_ids=prompt_ids, response_ids=response_ids, response_mask=response_mask,
                sampler_logprobs=torch.zeros(n, r), rewards=rewards,
                advantages=pl_module.compute_advantages(rewards, g), group_size=g,
                prompts=[""] * n, completions=[""] * n,
            )
            batch["rollout_metrics"] = {"reward/mean": rewards.mean().item(), "timing/rollout_s": 0.0}
            if batch_idx == args.warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            if args.profile and batch_idx == args.warmup + args.steps:  # the extra, profiled step
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                                       + ([torch.profiler.ProfilerActivity.CUDA] if cuda else []))
                self.profiler.__enter__()
            sync()
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            sync()
            self.times.append(time.perf_counter() - self.started)
            m = trainer.callback_metrics
            self.train_s.append(float(m["timing/train_s"]))
            self.losses.append(float(m["loss"]))
            self.grad_norms.append(float(m["grad_norm"]))
            print(f"[{side}] step {batch_idx}: {self.times[-1]:.3f} s, loss {self.losses[-1]:.4g}, "
                  f"grad_norm {self.grad_norms[-1]:.4g}, peak {gib(torch.cuda.max_memory_allocated):.1f} GiB", flush=True)
            if getattr(self, "profiler", None) is not None:
                self.profiler.__exit__(None, None, None)
                self.profile = profile_summary(self.profiler, cuda)
                self.profiler = None

        def on_fit_end(self, trainer, pl_module) -> None:
            pass

    class Prompts(Dataset):  # the batch only carries an index; the callback fills the rollout
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> dict:
            return {"index": i}

    trace_modes: dict[str, int] = {}  # --profile: DeepSpeed ZeRO-3's parameter-trace mode at each step's end
    if args.profile and args.stage == 3:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

        reset_step = Coordinator.reset_step

        def counted_reset_step(self):  # complete: prefetching from the recorded trace; record/invalid: not
            mode = "complete" if self.is_complete_trace() else "record" if self.is_record_trace() else "invalid"
            trace_modes[mode] = trace_modes.get(mode, 0) + 1
            return reset_step(self)

        Coordinator.reset_step = counted_reset_step

    tok_dir = tempfile.mkdtemp(prefix="grpo-bench-tok-")
    build_tokenizer().save_pretrained(tok_dir)
    pl.seed_everything(0, verbose=False)
    module = Bench(
        model=model_config(args.model), tokenizer=tok_dir, dtype="bfloat16",
        sampling=SamplingOptions(group_size=g, max_prompt_length=p, max_response_length=r),
        optim=OptimOptions(learning_rate=1e-6, max_grad_norm=1.0, mini_batches=1),
        compute=ComputeOptions(zorro=(side == "zorro"),
                               attention_backend=args.attention_backend if side == "zorro" and cuda else "auto",
                               gradient_checkpointing={"true": True, "false": False}.get(args.gradient_checkpointing, args.gradient_checkpointing), micro_batch_size=args.micro_batch_size, liger=LIGER[args.liger]),
    )
    rollouts = ScriptedRollouts()
    strategy = ArcticStrategy(stage=args.stage, config=json.loads(args.ds_config) if args.ds_config else None)
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, precision="bf16-mixed", strategy=strategy,
        max_steps=args.warmup + args.steps + (1 if args.profile else 0), logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
        default_root_dir=tempfile.mkdtemp(prefix="grpo-bench-"), callbacks=[rollouts],
    )
    started = time.perf_counter()
    trainer.fit(module, train_dataloaders=DataLoader(Prompts(), batch_size=n_prompts))
    fit_s = time.perf_counter() - started

    timed = rollouts.times[args.warmup : args.warmup + args.steps]
    step_s = statistics.median(timed)
    naive_tokens, dedup_tokens = n * (p + r), n_prompts * (p + g * r)
    processed = dedup_tokens if side == "zorro" else naive_tokens
    return {
        "side": side,
        "step_s_median": round(step_s, 4),
        "step_s_mean": round(statistics.mean(timed), 4),
        "step_s_all": [round(x, 4) for x in rollouts.times],
        "module_train_s": [round(x, 4) for x in rollouts.train_s],
        # per measured step: forward+backward (backward_batch) and the optimizer step (apply_gradients); the rest
        # of the step is Lightning's loop, advantages, metrics and logging
        **{f"{k}_median": round(statistics.median(v[args.warmup : args.warmup + args.steps]), 4)
           for k, v in phases.items() if len(v) > args.warmup},
        "fwd_bwd_s_all": [round(x, 4) for x in phases["fwd_bwd_s"]],
        "optimizer_s_all": [round(x, 4) for x in phases["optimizer_s"]],
        "spread_max_over_median": round(max(timed) / step_s, 3),
        "stage": args.stage,
        "profile": getattr(rollouts, "profile", None),
        "zero3_trace_modes": trace_modes or None,
        "optimizer_fused": torch_optimizer(trainer.optimizers[0]).defaults.get("fused") is True,
        "tokens_naive": naive_tokens,
        "tokens_dedup": dedup_tokens,
        "tokens_processed": processed,
        "naive_tokens_per_s": round(naive_tokens / step_s),
        "dedup_tokens_per_s": round(dedup_tokens / step_s),
        "processed_tokens_per_s": round(processed / step_s),
        "peak_gib": round(gib(torch.cuda.max_memory_allocated), 2),
        "after_setup_gib": round(rollouts.after_setup_gib, 2),
        "losses": rollouts.losses,
        "grad_norms": rollouts.grad_norms,
        "fit_s": round(fit_s, 1),
        "params": sum(getattr(q, "ds_numel", q.numel()) for q in module.model.parameters()),
        "liger_modules": sum(has_liger(m) for m in module.model.modules()),  # given a Liger kernel
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8, help="G, samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--response-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=None, help="sequences per fwd/bwd (default: all)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps after warm-up")
    parser.add_argument("--sides", default="zorro,naive", help="comma list of zorro,naive; each runs in its own process")
    parser.add_argument("--ds-config", default=None, help="JSON merged over ArcticStrategy's DeepSpeed config")
    parser.add_argument("--side-timeout", type=float, default=None, help="seconds per side process")
    parser.add_argument("--out", default=None, help="write the JSON summary here")
    parser.add_argument("--liger", default="false", choices=sorted(LIGER), help="GRPOModule's liger (default false)")
    parser.add_argument("--attention-backend", default="flex", help="ZoRRo side's attention_backend (flex, cudnn, ...)")
    parser.add_argument("--gradient-checkpointing", default="true", choices=["true", "false", "selective"])
    parser.add_argument("--accelerator", default="gpu", help="gpu; cpu only to check the script (DS_ACCELERATOR=cpu)")
    parser.add_argument("--stages", default="3", help="comma list of ZeRO stages (1, 2, 3); each side runs at each")
    parser.add_argument("--stage", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help="profile one extra step after the measured ones")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sides = [s for s in args.sides.split(",") if s]
    if args.child:  # one side, in this process
        result = run_side(args, sides[0])
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    import torch
    import transformers

    summary = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "model": args.model, "shape": SHAPES[args.model],
        "case": {"prompts": args.prompts, "G": args.group, "prompt_len": args.prompt_len,
                 "response_len": args.response_len, "micro_batch_size": args.micro_batch_size},
        "warmup": args.warmup, "steps": args.steps, "liger": args.liger,
        "setup": f"Trainer(gpu, devices=1, bf16-mixed, ArcticStrategy(stage in {args.stages})); GRPOModule gradient_checkpointing={args.gradient_checkpointing}, "
                 "mini_batches=1, torch AdamW under ZeRO; scripted rollouts, full-length responses",
        "sides": {},
    }
    base = [sys.executable, os.path.abspath(__file__), "--child"]
    runs = [(side, int(stage)) for stage in args.stages.split(",") for side in sides]
    for side, stage in runs:
        name = side if args.stages == "3" else f"{side}_zero{stage}"
        part = tempfile.mktemp(suffix=f"-{name}.json")
        cmd = base + [f"--model={args.model}", f"--prompts={args.prompts}", f"--group={args.group}",
                      f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}",
                      f"--warmup={args.warmup}", f"--steps={args.steps}", f"--sides={side}", f"--out={part}",
                      f"--accelerator={args.accelerator}", f"--liger={args.liger}",
                      f"--attention-backend={args.attention_backend}", f"--gradient-checkpointing={args.gradient_checkpointing}",
                      f"--stage={stage}"] + (["--profile"] if args.profile else [])
        if args.micro_batch_size:
            cmd.append(f"--micro-batch-size={args.micro_batch_size}")
        if args.ds_config:
            cmd.append(f"--ds-config={args.ds_config}")
        try:
            proc = subprocess.run(cmd, timeout=args.side_timeout)
            if proc.returncode == 0 and os.path.exists(part):
                with open(part) as f:
                    summary["sides"][name] = json.load(f)
            else:
                summary["sides"][name] = {"error": f"exit code {proc.returncode}"}
        except subprocess.TimeoutExpired:
            summary["sides"][name] = {"error": f"timed out after {args.side_timeout} s"}
        if args.out:  # after every side: a later failure keeps what was measured
            with open(args.out, "w") as f:
                json.dump(summary, f, indent=1)
    z, b = summary["sides"].get("zorro", {}), summary["sides"].get("naive", {})
    if "step_s_median" in z and "step_s_median" in b and z["peak_gib"] > 0:
        summary["speedup"] = round(b["step_s_median"] / z["step_s_median"], 2)
        summary["peak_ratio"] = round(b["peak_gib"] / z["peak_gib"], 2)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
