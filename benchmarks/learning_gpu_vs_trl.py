"""A run that learns on one GPU, arctic-rl against TRL 1.16's ``GRPOTrainer``: wall time to a target reward.

The task is the quickstart's echo-the-digit, scaled up: a Qwen3 of about 3.4M parameters from random
weights (seeded), and the digit repeated over ``--slots`` response tokens (reward: the fraction of the first
``slots`` words equal to the digit). Both sides use the same model init, data, reward and hyperparameters:
G = 8 x ``--prompts``, lr with 5 warm-up steps then constant, dapo, clip 0.2, beta 0, temperature 1.
- arctic-rl: ``arctic-rl fit``, ArcticStrategy (ZeRO stage 1), ZoRRo, Liger (auto), bf16-mixed, the
  transformers engine colocated on the GPU (CUDA graphs).
- TRL: ``GRPOTrainer`` without vLLM (transformers ``generate``), bf16, ``use_liger_kernel``, and
  ``--trl-cache`` for its ``cache_implementation`` (``dynamic`` or ``static``).

    python benchmarks/learning_gpu_vs_trl.py --seeds 0-2 --sides arctic,trl --steps 150 --out learning_gpu.json

Reported per side and seed: reward and elapsed wall time of every step, the step and the time at which the
10-step mean first reaches ``--target``, the peak GPU memory, and arctic-rl's generation / training /
weight-push split. ``--device cpu`` runs the same code on the CPU (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arctic_rl.modules.grpo import GRPOModule  # noqa: E402
from arctic_rl.tasks.toy import build_tokenizer, make_rows  # noqa: E402
from benchmarks.learning_vs_trl import fit_rows, parse_seeds, step_to_mean  # noqa: E402

SLOTS = int(os.environ.get("ARCTIC_RL_ECHO_SLOTS", "32"))  # read by the task class in the fit subprocess too
MODEL = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 256,
         "tie_word_embeddings": True}
GROUP, WARMUP = 8, 5


def echo_slots(completion: str, answer: str) -> float:
    words = completion.split()[:SLOTS]
    return sum(w == answer for w in words) / SLOTS


class EchoLongGRPO(GRPOModule):
    """The echo task over ``SLOTS`` response tokens."""

    def reward(self, prompts, completions, answer, **columns):
        return [echo_slots(c, a) for c, a in zip(completions, answer)]


class StepClock(Callback):
    """Logs, at each step's end, the wall time since training started (``clock/elapsed_s``), since the step
    began (``clock/batch_start_s``: listed first, so before the rollout callback runs), the seconds from the
    launcher's start of the process to training's start (``clock/launch_to_train_s``) and the peak GPU memory."""

    def on_train_start(self, trainer, pl_module):
        self.started, self.started_unix = time.perf_counter(), time.time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_start = time.perf_counter() - self.started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.log("clock/elapsed_s", time.perf_counter() - self.started)
        pl_module.log("clock/batch_start_s", self.batch_start)
        pl_module.log("clock/launch_to_train_s", self.started_unix - float(os.environ.get("ARCTIC_RL_BENCH_LAUNCHED", "nan")))
        if torch.cuda.is_available():
            pl_module.log("clock/peak_gib", torch.cuda.max_memory_allocated() / 2**30)


def write_model(out: Path, seed: int) -> Path:
    from arctic_rl.modules.models import build_causal_lm

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    build_causal_lm({**MODEL, "vocab_size": len(tokenizer)}, "float32").save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def run_arctic(model_dir: Path, data: Path, seed: int, args, workdir: Path) -> dict:
    gpu = args.device == "cuda"
    config = {
        "seed_everything": seed,
        "model": {"class_path": "benchmarks.learning_gpu_vs_trl.EchoLongGRPO", "init_args": {
            "model": str(model_dir), "tokenizer": str(model_dir),
            "sampling": {"seed": seed, "group_size": GROUP, "max_prompt_length": 32, "max_response_length": SLOTS, "temperature": 1.0},
            "optim": {"learning_rate": args.lr, "warmup_steps": WARMUP}, "loss": {"loss_type": "dapo"},
            "rollout": {"advantage_estimator": "grpo"}}},
        "data": {"class_path": "arctic_rl.PromptDataModule",
                 "init_args": {"train_path": str(data), "batch_size": args.prompts, "seed": seed}},
        "trainer": {
            "max_steps": args.steps, "accelerator": "gpu" if gpu else "cpu", "devices": 1,
            "precision": "bf16-mixed" if gpu else "32-true", "default_root_dir": str(workdir), "log_every_n_steps": 1,
            "enable_progress_bar": False, "enable_checkpointing": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(workdir), "name": "logs"}},
            "callbacks": [{"class_path": "benchmarks.learning_gpu_vs_trl.StepClock"},
                          {"class_path": "arctic_rl.RolloutCallback", "init_args": {"engine": "transformers"}}]},
    }
    if gpu:
        config["trainer"]["strategy"] = {"class_path": "arctic_rl.strategies.ArcticStrategy", "init_args": {"stage": 1}}
    env = {"ARCTIC_RL_ECHO_SLOTS": str(SLOTS), "ARCTIC_RL_BENCH_LAUNCHED": repr(time.time())}
    steps = fit_rows(config, workdir, f"arctic-rl seed {seed}", args.steps, env)
    split = {k: sum(float(r[k]) for r in steps[1:]) / (len(steps) - 1) for k in ("timing/rollout_s", "timing/train_s", "timing/sync_s")
             if k in steps[0]}  # steady state: step 0 (warm-ups, the self-check) is reported on its own
    first = {k: float(steps[0][k]) for k in ("clock/batch_start_s", "timing/rollout_s", "timing/train_s", "self_check/seconds",
                                             "clock/elapsed_s") if steps[0].get(k)}
    return {"rewards": [float(r["reward"]) for r in steps], "elapsed_s": [float(r["clock/elapsed_s"]) for r in steps],
            "launch_to_train_s": float(steps[0]["clock/launch_to_train_s"]), "mean_step_split_s": split, "first_step_s": first, "peak_gib": max(float(r.get("clock/peak_gib") or 0) for r in steps),
            "metrics_csv": str(next(workdir.glob("logs/version_*/metrics.csv")))}


def run_trl(model_dir: Path, data: Path, seed: int, args, workdir: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rewards, elapsed = [], []

    def reward(prompts, completions, answer, **columns):
        scores = [echo_slots(c, a) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.started, self.started_unix = time.perf_counter(), time.time()

        def on_step_end(self, *a, **k):
            elapsed.append(time.perf_counter() - self.started)

    gpu = args.device == "cuda"
    config = GRPOConfig(
        output_dir=str(workdir), per_device_train_batch_size=GROUP * args.prompts, num_generations=GROUP,
        max_completion_length=SLOTS, max_steps=args.steps, learning_rate=args.lr, warmup_steps=WARMUP,
        lr_scheduler_type="constant_with_warmup", loss_type="dapo", epsilon=0.2, beta=0.0, temperature=1.0,
        seed=seed, data_seed=seed, logging_steps=1, report_to=[], use_cpu=not gpu, bf16=gpu, save_strategy="no",
        disable_tqdm=True, use_liger_kernel=gpu and args.trl_liger, cache_implementation=args.trl_cache,
    )
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    launched, clock = time.time(), Clock()
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          callbacks=[clock])
    trainer.train()
    return {"rewards": rewards, "elapsed_s": elapsed, "launch_to_train_s": clock.started_unix - launched, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if gpu else 0.0}


def one(side: str, seed: int, args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"arctic-rl-gpu-vs-trl-{side}{seed}-"))
    model_dir = write_model(workdir / "model", seed)
    data = workdir / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(512, 0)))
    run = (run_arctic if side == "arctic" else run_trl)(model_dir, data, seed, args, workdir)
    at = step_to_mean(run["rewards"], args.target)
    return {**run, "step_to_target": at, "time_to_target_s": None if at is None else run["elapsed_s"][at],
            "launch_to_target_s": None if at is None else run["launch_to_train_s"] + run["elapsed_s"][at],
            "last10": sum(run["rewards"][-10:]) / 10}


def plot(result: dict, png: Path) -> None:
    """Reward (10-step mean) of every run over steps and over wall time since training started, both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"arctic": "tab:blue", "trl": "tab:orange"}
    for side, runs in result["runs"].items():
        for seed, run in runs.items():
            if "rewards" not in run:  # a run kept as its summary only
                continue
            rewards = run["rewards"]
            smooth = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
            label = f"{side} seed {seed}"
            by_step.plot(range(len(smooth)), smooth, color=colors.get(side), alpha=0.8, label=label)
            by_time.plot(run["elapsed_s"][: len(smooth)], smooth, color=colors.get(side), alpha=0.8, label=label)
    for ax, xlabel in ((by_step, "step"), (by_time, "seconds since training started")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("reward (10-step mean)")
        ax.grid(alpha=0.3)
    by_time.legend(fontsize=7)
    fig.suptitle(f"echo over {result['slots']} tokens: arctic-rl vs TRL GRPOTrainer, one GPU")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-2")
    parser.add_argument("--sides", default="arctic,trl")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--trl-cache", default=None, choices=[None, "static"], help="TRL's cache_implementation")
    parser.add_argument("--trl-liger", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot-from", type=Path, help="draw a result JSON of this script as --png and exit")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), args.png or args.plot_from.with_suffix(".png"))
        return
    result = {"command": " ".join(sys.argv), "slots": SLOTS, "model": MODEL, "runs": {}}
    for seed in parse_seeds(args.seeds):  # seed-major: a run cut short still has both sides of its first seeds
        for side in args.sides.split(","):
            started = time.perf_counter()
            row = one(side, seed, args)
            row["process_wall_s"] = time.perf_counter() - started
            result["runs"].setdefault(side, {})[seed] = row
            print(json.dumps({"side": side, "seed": seed, **{k: v for k, v in row.items() if k not in ("rewards", "elapsed_s")}}),
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
