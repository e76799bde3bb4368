"""Synchronous rollouts against the rollout stream (``RolloutCallback.partial_rollout_tokens``) on a task whose
response lengths are heavy-tailed and the policy's own (``arctic_rl.tasks.repeat_toy``), through ``arctic-rl fit``
with the transformers engine in the training process (the GPU machine here has no vLLM or Ray).

    python benchmarks/stream_gpu.py --seeds 0 1 2 --steps 150 --out stream_gpu.json                   # the H200
    python benchmarks/stream_gpu.py --shape tiny --accelerator cpu --engine_device cpu --steps 4    # a CPU smoke run

Each (seed, mode) runs in a fresh process, the modes alternating per seed on the same data, initial weights and
sampling seeds. ``sync``: ``max_staleness: 0`` (each batch sampled whole from the current weights before its step).
``k1``: ``max_staleness: 1`` (the next batch sampled beside the step, no partial rollouts).
``stream``: ``max_staleness`` k, ``partial_rollout_tokens`` b, rounds beside each training step for as long as it
lasts (``rounds_per_step: null``). Reported per run: ``fit_s``, the wall time of the fit (start of training to its end, from
``quickstart.StepClock``), the seconds at which the reward's running mean over ``--window`` steps first reaches
each of ``--targets``, the median step and its ``timing/*``, and the stream's staleness and partial-token share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml
from overlap_gpu import fit_trainer, run_fit

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 128, "tie_word_embeddings": True}
SHAPES = {"tiny": TINY, "small": {**TINY, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}}


def run_config(tmp: Path, name: str, args, seed: int, mode: str, task: Path, vocab: int, clock: Path) -> Path:
    stream = mode == "stream"
    callback = {"engine": "transformers", "log_samples_every_n_steps": 0, "engine_kwargs": {"device": args.engine_device},
                "max_staleness": args.max_staleness if stream else 1 if mode == "k1" else 0}
    if stream:
        callback.update(partial_rollout_tokens=args.budget, over_provisioning=args.over_provisioning, rounds_per_step=None)
    precision = "bf16-true" if args.accelerator == "gpu" else "32-true"
    config = {
        "seed_everything": seed,
        "model": {"class_path": "arctic_rl.tasks.repeat_toy.RepeatDigitGRPO", "init_args": {
            "graded_stop": args.graded_stop, "model": {**SHAPES[args.shape], "vocab_size": vocab}, "tokenizer": str(task / "tokenizer"),
            "dtype": "bfloat16" if args.accelerator == "gpu" else "float32",
            "sampling": {"group_size": args.group_size, "max_prompt_length": 16, "max_response_length": args.response_tokens,
                         "temperature": 1.0, "seed": seed},
            "optim": {"learning_rate": args.lr, "warmup_steps": 5},
            "compute": {"self_check": False}}},
        "data": {"class_path": "arctic_rl.PromptDataModule",
                 "init_args": {"train_path": str(task / "train.jsonl"), "batch_size": args.prompts, "seed": seed}},
        "trainer": fit_trainer(tmp, name, args.accelerator, precision, args.steps, callback, clock),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def time_to(rewards: list[float], seconds: list[float], target: float, window: int) -> float | None:
    """Seconds from the start of training to the end of the first step where the running mean reaches ``target``."""
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1 : i + 1]) >= target:
            return round(seconds[i], 2)
    return None


def one_run(tmp: Path, name: str, args, seed: int, mode: str, task: Path, vocab: int) -> dict:
    clock = tmp / f"{name}.clock.jsonl"
    events, rows, seconds = run_fit(tmp, name, run_config(tmp, name, args, seed, mode, task, vocab, clock), clock)
    t0 = next(e["t"] for e in events if e["event"] == "train_start")
    ends = [e["t"] - t0 for e in events if e["event"] == "batch_end"]
    rewards = [r["reward"] for r in rows]

    def median(key: str) -> float | None:
        values = [r[key] for r in rows[1:] if key in r]  # the first step warms up
        return round(statistics.median(values), 4) if values else None

    return {"mode": mode, "seed": seed, "process_s": round(seconds, 1),
            "fit_s": round(ends[-1], 2), "step_s_median": round(statistics.median(b - a for a, b in zip(ends, ends[1:])), 4),
            "time_to": {str(t): time_to(rewards, ends, t, args.window) for t in args.targets},
            "final_reward": round(statistics.fmean(rewards[-args.window:]), 4),
            **{key.replace("/", "."): median(key) for key in ("timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/rollout_wait_s",
                                                              "timing/engine_idle_s", "response_length/mean", "response_length/max",
                                                              "stream/partial_token_frac", "stream/staleness_mean")},
            "max_staleness_seen": max((r.get("rollout/staleness", 0.0) for r in rows), default=0.0),
            "regenerated_groups": sum(r.get("stream/regenerated_groups", 0.0) for r in rows),
            "reward": [round(x, 4) for x in rewards]}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--response_tokens", type=int, default=56)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max_staleness", type=int, default=2)
    parser.add_argument("--budget", type=int, default=16, help="partial_rollout_tokens")
    parser.add_argument("--over_provisioning", type=int, default=1)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    parser.add_argument("--window", type=int, default=10)
    parser.add_argument("--engine_device", default="cuda:0")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--accelerator", default="gpu")
    parser.add_argument("--modes", nargs="+", default=["sync", "stream"], choices=["sync", "k1", "stream"],
                        help="sync: max_staleness 0; k1: max_staleness 1 (the next batch sampled beside the step); stream: the "
                             "rollout stream at --max_staleness with partial rollouts of --budget tokens")
    parser.add_argument("--max_count", type=int, default=48, help="the task's largest count (its tail)")
    parser.add_argument("--graded_stop", action="store_true", help="RepeatDigitGRPO(graded_stop=True)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from arctic_rl.tasks.repeat_toy import repeat_tokenizer, write_task

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task = write_task(tmp / "task", num_train=2048, max_count=args.max_count)
        vocab = len(repeat_tokenizer(args.max_count))
        for seed in args.seeds:
            for mode in args.modes:
                runs.append(one_run(tmp, f"{mode}{seed}", args, seed, mode, task, vocab))
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "reward"}), flush=True)
    result = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "shape": args.shape, "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()}, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
