"""Synchronous vs overlapped rollouts (``RolloutCallback.max_staleness`` 0 vs 1) on the GPU, through
``arctic-rl fit``: a Qwen3-0.6B-shaped policy (random weights), the transformers engine in the training
process (the GPU machine here has no vLLM or Ray), bf16, the toy echo task with long filler prompts.

    python benchmarks/overlap_gpu.py --steps 8 --out overlap_gpu.json                       # engine on GPU 1 if there are 2, else beside training
    python benchmarks/overlap_gpu.py --engine_device cuda:0 --out overlap_gpu_shared.json   # force one shared GPU

Each mode runs in a fresh process, the modes alternating (``--repeats``). With ``max_staleness: 0`` the
engine moves its weights to the CPU while training runs (``sleep``) and back before the push; with 1 it
stays on its GPU and generates batch t+1 on its own CUDA stream while batch t trains. Reported per run: the
median step (one step's start to the next's, from ``quickstart.StepClock``), the medians of the run's
``timing/*`` metrics (``rollout_wait_s``: what an overlapped step waited for its rollout) and the staleness.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QWEN3_0_6B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": True}
SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "tiny": {**QWEN3_0_6B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}}  # tiny: a CPU smoke run


def write_data(out: Path, prompt_words: int, rows: int) -> Path:
    """The echo task's rows with ``prompt_words`` filler words in front of ``echo D :``."""
    rng = random.Random(0)
    with open(out, "w") as f:
        for _ in range(rows):
            digit = str(rng.randrange(10))
            filler = " ".join(f"w{rng.randrange(100, 150000)}" for _ in range(prompt_words))
            f.write(json.dumps({"prompt": f"{filler} echo {digit} :", "answer": digit}) + "\n")
    return out


def run_config(tmp: Path, name: str, args, staleness: int, tokenizer: Path, data: Path, clock: Path) -> Path:
    callback = {"engine": "transformers", "max_staleness": staleness, "log_samples_every_n_steps": 0,
                "engine_kwargs": {"device": args.engine_device}}
    config = {
        "seed_everything": 0,
        "model": {"class_path": "arctic_rl.tasks.toy.EchoDigitGRPO", "init_args": {
            "model": SHAPES[args.shape], "tokenizer": str(tokenizer), "dtype": "bfloat16", "group_size": args.group_size,
            "learning_rate": 1e-6, "max_prompt_length": args.prompt_words + 8, "max_response_length": args.response_tokens,
            "micro_batch_size": args.micro_batch_size, "gradient_checkpointing": True, "self_check": False}},
        "data": {"class_path": "arctic_rl.PromptDataModule", "init_args": {"train_path": str(data), "batch_size": args.prompts}},
        "trainer": fit_trainer(tmp, name, args.accelerator, "bf16-true", args.steps, callback, clock),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def fit_trainer(tmp: Path, name: str, accelerator: str, precision: str, steps: int, callback: dict, clock: Path) -> dict:
    """A benchmark run's ``trainer`` section: one device, CSV logs under ``tmp/name``, no checkpoints, the rollout
    callback with ``callback`` and :class:`quickstart.StepClock` writing to ``clock``."""
    return {"accelerator": accelerator, "devices": 1, "precision": precision, "max_steps": steps,
            "default_root_dir": str(tmp / name), "log_every_n_steps": 1, "enable_progress_bar": False,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp / name), "name": "logs"}},
            "enable_checkpointing": False,
            "callbacks": [{"class_path": "arctic_rl.RolloutCallback", "init_args": callback},
                          {"class_path": "quickstart.StepClock", "init_args": {"path": str(clock)}}]}


def run_fit(tmp: Path, name: str, config: Path, clock: Path) -> tuple[list[dict], list[dict], float]:
    """``arctic-rl fit --config config`` in a fresh process; returns the clock's stamps, the logged rows of the
    training steps and the process's seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    if done.returncode:
        print(done.stdout[-3000:], done.stderr[-6000:])
        raise SystemExit(done.returncode)
    events = [json.loads(line) for line in clock.read_text().splitlines()]
    with open(next((tmp / name / "logs").glob("version_*/metrics.csv"))) as f:
        rows = [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]
    return events, [r for r in rows if "timing/train_s" in r], time.perf_counter() - started


def step_summary(events: list[dict], rows: list[dict], seconds: float, keys: tuple[str, ...]) -> dict:
    """A run's wall time, its median step (one step's start to the next's, the first step left out as warm-up) and the
    medians of the logged ``keys`` over the steps after the first."""
    starts = [e["t"] for e in events if e["event"] == "batch_start"]

    def median(key: str) -> float | None:
        values = [r[key] for r in rows[1:] if key in r]  # the first step warms up
        return round(statistics.median(values), 4) if values else None

    return {"wall_s": round(seconds, 1), "step_s_median": round(statistics.median(b - a for a, b in zip(starts[1:], starts[2:])), 4),
            **{key.split("/")[-1]: median(key) for key in keys}}


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every fit benchmark of this family takes: run length, batch shape, model shape, device, output."""
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--prompt_words", type=int, default=256)
    parser.add_argument("--response_tokens", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=32)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--accelerator", default="gpu", help="cpu (with --shape tiny): a smoke run")
    parser.add_argument("--out", type=Path)


def one_run(tmp: Path, name: str, args, staleness: int, tokenizer: Path, data: Path) -> dict:
    clock = tmp / f"{name}.clock.jsonl"
    events, rows, seconds = run_fit(tmp, name, run_config(tmp, name, args, staleness, tokenizer, data, clock), clock)
    return {"mode": name, "max_staleness": staleness,
            **step_summary(events, rows, seconds, ("timing/rollout_s", "timing/train_s", "timing/sync_s", "timing/rollout_wait_s")),
            "staleness": [r.get("rollout/staleness") for r in rows], "reward": [round(r["reward"], 4) for r in rows]}


def alternate_runs(args, modes: dict) -> list[dict]:
    """Each of ``modes`` (name -> ``run(tmp, run_name, tokenizer, data) -> dict``) ``args.repeats`` times, the modes
    alternating, in one temporary directory holding the word tokenizer and the filler data; each result printed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from recipe_gsm8k_gpu import word_tokenizer

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = word_tokenizer(QWEN3_0_6B["vocab_size"], tmp / "tokenizer")
        data = write_data(tmp / "train.jsonl", args.prompt_words, 16 * args.prompts)
        for r in range(args.repeats):
            for name, run in modes.items():
                runs.append(run(tmp, f"{name}{r}", tokenizer, data))
                print(json.dumps(runs[-1]), flush=True)
    return runs


def report(result: dict, out: Path | None) -> None:
    print(json.dumps(result, indent=1))
    if out:
        out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)  # --accelerator cpu needs --shape tiny --engine_device cpu
    parser.add_argument("--engine_device", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    args = parser.parse_args()
    runs = alternate_runs(args, {name: (lambda tmp, run, tokenizer, data, staleness=staleness:
                                        one_run(tmp, run, args, staleness, tokenizer, data))
                                 for name, staleness in (("sync", 0), ("overlap", 1))})
    report({"command": " ".join(sys.argv), "gpus": torch.cuda.device_count(), "engine_device": args.engine_device,
            "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "shape": args.shape,
            "torch": torch.__version__, "runs": runs}, args.out)

if __name__ == "__main__":
    main()
