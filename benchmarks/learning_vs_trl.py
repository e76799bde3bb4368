"""Learning curves of arctic-rl against TRL 1.16's own ``GRPOTrainer`` on the quickstart's echo-digit task,
over several seeds, with everything matched: the same initial weights (``write_tiny_model(seed)``),
tokenizer, ``train.jsonl``, reward, G=8 x 16 prompts, lr 3e-3 with 5 warm-up steps then constant, dapo,
clip 0.2, beta 0, 8 new tokens, temperature 1, one optimizer step per generation batch.

    python benchmarks/learning_vs_trl.py --seeds 0-7 --sides trl,vllm,transformers --steps 200 \
        --out benchmarks/results/learning_vs_trl_<date>.json

``trl`` runs ``GRPOTrainer`` in this process (``use_vllm=False``: transformers ``generate``); ``vllm`` and
``transformers`` run ``arctic-rl fit`` (the quickstart config with this seed's model directory) with that
rollout engine. Reported per side and seed: the reward of every step, the step at which the 10-step mean
first reaches 0.9, and the last-10-step mean.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arctic_rl.tasks.toy import echo_score, write_tiny_model  # noqa: E402

LEARNING_RATE, WARMUP, GROUP, PROMPTS = 3e-3, 5, 8, 16


def step_to_mean(rewards: list[float], target: float, window: int = 10) -> int | None:
    """First step whose trailing ``window``-step mean reward is >= ``target`` (None: never)."""
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= target:
            return i
    return None


def summary(rewards: list[float]) -> dict:
    return {"step_to_0.9": step_to_mean(rewards, 0.9), "first10": sum(rewards[:10]) / 10,
            "last10": sum(rewards[-10:]) / 10, "rewards": [round(r, 5) for r in rewards]}


def run_trl(model_dir: Path, seed: int, steps: int, workdir: Path, schedule: str = "constant_with_warmup",
            rows: list[dict] | None = None, score=None, completion_tokens: int = 8, learning_rate: float = LEARNING_RATE,
            group_size: int = GROUP, prompts: int = PROMPTS) -> list[float]:
    """TRL's ``GRPOTrainer`` on the task; the mean reward of each step's rollouts. By default the echo task
    (``data/toy/train.jsonl``, ``echo_score``); ``rows``, ``score(completion, **row_columns)`` and
    ``completion_tokens`` give another (and ``learning_rate``, ``group_size``, ``prompts`` per step other sizes)."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(os.environ.get("ARCTIC_RL_BENCH_THREADS", torch.get_num_threads())))
    if rows is None:
        rows = [json.loads(line) for line in (ROOT / "data/toy/train.jsonl").read_text().splitlines()]
    if score is None:
        score = echo_score
    columns_of_rows = [k for k in rows[0] if k != "prompt"]
    rewards: list[float] = []

    def task_reward(prompts, completions, **columns):
        scores = [score(c, **{k: columns[k][i] for k in columns_of_rows}) for i, c in enumerate(completions)]
        rewards.append(sum(scores) / len(scores))
        return scores

    args = GRPOConfig(
        output_dir=str(workdir), per_device_train_batch_size=group_size * prompts, num_generations=group_size,
        max_completion_length=completion_tokens, max_steps=steps, learning_rate=learning_rate, warmup_steps=WARMUP,
        lr_scheduler_type=schedule, loss_type="dapo", epsilon=0.2, beta=0.0, temperature=1.0,
        seed=seed, data_seed=seed, logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=task_reward, args=args, train_dataset=Dataset.from_list(rows))
    trainer.train()
    return rewards


def run_arctic(model_dir: Path, seed: int, steps: int, workdir: Path, engine: str) -> list[float]:
    """``arctic-rl fit`` on the quickstart config with this model and seed; the logged reward of each step."""
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = seed
    config["model"]["init_args"].update(model=str(model_dir), tokenizer=str(model_dir))
    config["model"]["init_args"]["sampling"]["seed"] = seed
    config["data"]["init_args"].update(train_path=str(ROOT / "data/toy/train.jsonl"), seed=seed)
    trainer = config["trainer"]
    trainer.update(max_steps=steps, default_root_dir=str(workdir), enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(workdir)
    trainer["callbacks"] = [cb for cb in trainer["callbacks"] if not cb["class_path"].endswith("ModelCheckpoint")]
    for cb in trainer["callbacks"]:
        if cb["class_path"].endswith("RolloutCallback"):
            cb["init_args"]["engine"] = engine
    rows = fit_rows(config, workdir, f"arctic-rl ({engine}) seed {seed}", steps)
    return [float(r["reward"]) for r in rows]


def fit_rows(config: dict, workdir: Path, what: str, steps: int, env: dict | None = None) -> list[dict[str, str]]:
    """``arctic-rl fit`` on ``config`` (written to ``workdir/config.yaml``) in a fresh process, its output in
    ``workdir/console.log``; the ``metrics.csv`` row of each of its ``steps`` steps, in order. ``what`` names the run
    in errors; ``env``: more environment for the process."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    with open(workdir / "console.log", "w") as console:
        code = subprocess.call([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(path)], cwd=workdir,
                               stdout=console, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        raise RuntimeError(f"{what}: exit {code}; see {workdir / 'console.log'}")
    with open(next(workdir.glob("logs/version_*/metrics.csv"))) as f:
        by_step = {int(r["step"]): r for r in csv.DictReader(f) if r.get("reward")}
    if sorted(by_step) != list(range(steps)):
        raise RuntimeError(f"{what}: metrics.csv has rewards for {len(by_step)} of {steps} steps")
    return [by_step[s] for s in range(steps)]


def parse_seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def one(side: str, seed: int, steps: int) -> dict:
    """One run in this process: ``side`` is ``trl`` (``trl-linear``: TRL's default linear decay), ``vllm`` or
    ``transformers``."""
    workdir = Path(tempfile.mkdtemp(prefix=f"arctic-rl-vs-trl-{side}{seed}-"))
    model_dir = write_tiny_model(workdir / "model", seed=seed)
    started = time.time()
    if side.startswith("trl"):
        schedule = "linear" if side == "trl-linear" else "constant_with_warmup"
        rewards = run_trl(model_dir, seed, steps, workdir / "trl", schedule)
    else:
        rewards = run_arctic(model_dir, seed, steps, workdir, side)
    return {**summary(rewards), "wall_s": round(time.time() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-7")
    parser.add_argument("--sides", default="trl,vllm,transformers")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time, each in its own process")
    parser.add_argument("--one", nargs=2, metavar=("SIDE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one[0], int(args.one[1]), args.steps)), flush=True)
        return
    results: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.node()} {os.cpu_count()} cores",
                     "steps": args.steps, "runs": {}}
    from concurrent.futures import ThreadPoolExecutor

    def child(side: str, seed: int) -> tuple[str, int, dict]:
        cmd = [sys.executable, __file__, "--steps", str(args.steps), "--one", side, str(seed)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{side} seed {seed}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return side, seed, json.loads(lines[-1][len("RESULT "):])

    jobs = [(side, seed) for side in args.sides.split(",") for seed in parse_seeds(args.seeds)]
    with ThreadPoolExecutor(args.parallel) as pool:
        for side, seed, row in pool.map(lambda job: child(*job), jobs):
            results["runs"].setdefault(side, {})[seed] = row
            print(json.dumps({"side": side, "seed": seed, **{k: v for k, v in row.items() if k != "rewards"}}), flush=True)
            if args.out:
                args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
