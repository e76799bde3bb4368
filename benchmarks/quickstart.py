"""The CPU quickstart, end to end, over several seeds: start-up, first step, per-step split, wall, peak
memory and how fast the reward climbs.

    python benchmarks/quickstart.py --seeds 0,1,2 --out benchmarks/results/quickstart_cpu_<date>.json

Each seed runs ``arctic-rl fit --config configs/quickstart.yaml`` in a fresh process (the README's
command; ``--seed_everything``, the module's sampling seed and the data seed all set to the seed), with
the run's files in a temporary directory and one extra callback, :class:`StepClock`, that writes a
wall-clock stamp at the start of training and around every step. Reported per seed:

- ``startup_s``: process start to the start of training (imports, model build, engine start);
- ``first_step_s``: the first step and ``step_s_median`` over the others (one step's start to the next's:
  rollout, train, sync and Lightning's loop);
- ``rollout_s`` / ``train_s`` / ``sync_s``: medians of the run's own timing metrics;
- ``wall_s``: the whole process; ``peak_rss_gb``: the process's peak resident memory;
- ``step_to_0.9``: first step at which the mean reward of the last 10 steps is >= 0.9 (None: never),
  and the first/last-10-step reward means.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]


class StepClock(Callback):
    """A Lightning callback (imported by class path in the child) stamping the wall clock to a JSONL file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _stamp(self, event: str, step: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event": event, "step": step, "t": time.time()}) + "\n")

    def setup(self, trainer, pl_module, stage):  # imports, config and module built; the strategy not yet set up
        self._stamp("setup", trainer.global_step)

    def on_fit_start(self, trainer, pl_module):  # the strategy set up: process group, DeepSpeed, model, optimizer
        self._stamp("fit_start", trainer.global_step)

    def on_train_start(self, trainer, pl_module):
        self._stamp("train_start", trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._stamp("batch_start", trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._stamp("batch_end", trainer.global_step)


def run_config(workdir: Path, seed: int, max_steps: int, clock: Path, extra: dict, rollout_args: dict | None = None) -> Path:
    """The quickstart YAML with this run's seed, steps and paths (all inside ``workdir``); ``rollout_args``
    are added to the RolloutCallback's init_args."""
    config = yaml.safe_load((ROOT / "configs/quickstart.yaml").read_text())
    config["seed_everything"] = seed
    config["model"]["init_args"]["sampling"]["seed"] = seed
    config["model"]["init_args"]["tokenizer"] = str(ROOT / "data/toy/tokenizer")
    config["model"]["init_args"].update(extra)  # sections replace the quickstart's (flat keys: read with a warning)
    config["data"]["init_args"].update(train_path=str(ROOT / "data/toy/train.jsonl"), seed=seed)
    trainer = config["trainer"]
    trainer.update(max_steps=max_steps, default_root_dir=str(workdir), enable_progress_bar=False)
    trainer["logger"]["init_args"]["save_dir"] = str(workdir)
    for cb in trainer["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(workdir / "checkpoints")
        if cb["class_path"].endswith("RolloutCallback"):
            cb["init_args"].update(rollout_args or {})
    trainer["callbacks"].append({"class_path": "quickstart.StepClock", "init_args": {"path": str(clock)}})
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def clock_timing(clock: Path, started: float, wall: float) -> dict:
    """From :class:`StepClock`'s stamps: start-up (process start to training start, engine started),
    the first step and the median later step (each from one step's start to the next's: rollout,
    train, sync and the loop between), and the time after the last step (shutdown, summary)."""
    stamps = [json.loads(line) for line in clock.read_text().splitlines()]
    train_start = next(s["t"] for s in stamps if s["event"] == "train_start")
    starts = [s["t"] for s in stamps if s["event"] == "batch_start"]
    last_end = [s["t"] for s in stamps if s["event"] == "batch_end"][-1]
    return {
        "startup_s": round(train_start - started, 2),
        "first_step_s": round(starts[1] - train_start, 3),
        "step_s_median": round(statistics.median(b - a for a, b in zip(starts[1:], starts[2:])), 4),
        "after_last_step_s": round(wall - (last_end - started), 2),
    }


def step_to_mean(rewards: list[float], target: float, window: int = 10) -> int | None:
    for i in range(window - 1, len(rewards)):
        if sum(rewards[i - window + 1 : i + 1]) / window >= target:
            return i
    return None


def one_run(seed: int, max_steps: int, extra: dict, rollout_args: dict | None = None) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"arctic-rl-qs{seed}-"))
    clock = workdir / "clock.jsonl"
    config = run_config(workdir, seed, max_steps, clock, extra, rollout_args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.time()
    with open(workdir / "console.log", "w") as console:
        proc = subprocess.Popen([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(config)], env=env,
                                cwd=workdir, stdout=console, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.time() - started
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: exit {proc.returncode}; see {workdir / 'console.log'}")
    timing = clock_timing(clock, started, wall)
    with open(next(workdir.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    by_step: dict[int, dict] = {}
    for row in rows:
        for key, value in row.items():
            if value != "":
                by_step.setdefault(int(row["step"]), {})[key] = float(value)
    rewards = [by_step[s]["reward"] for s in sorted(by_step) if "reward" in by_step[s]]

    def median(key: str) -> float:
        return statistics.median(v[key] for v in by_step.values() if key in v)

    return {
        "seed": seed,
        "workdir": str(workdir),
        **timing,
        "rollout_s": round(median("timing/rollout_s"), 4),
        "train_s": round(median("timing/train_s"), 4),
        "sync_s": round(median("timing/sync_s"), 4),
        "rollout_wait_s": round(median("timing/rollout_wait_s"), 4) if "timing/rollout_wait_s" in rows[0] else None,
        "staleness_counts": {str(k): sum(v.get("rollout/staleness") == k for v in by_step.values()) for k in (0, 1, 2, 3)},
        "partial_token_frac": round(median("stream/partial_token_frac"), 3) if "stream/partial_token_frac" in rows[0] else None,
        "rewards": [round(r, 4) for r in rewards],
        "self_check_s": next((round(v["self_check/seconds"], 3) for v in by_step.values() if "self_check/seconds" in v), None),
        "wall_s": round(wall, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2),
        "step_to_0.9": step_to_mean(rewards, 0.9),
        "reward_first10": round(sum(rewards[:10]) / 10, 3),
        "reward_last10": round(sum(rewards[-10:]) / 10, 3),
        "steps": len(rewards),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--max_steps", type=int, default=200)
    parser.add_argument("--model_args", default="{}", help="JSON dict of extra model.init_args (sections, e.g. {\"optim\": {...}})")
    parser.add_argument("--rollout_args", default="{}", help="JSON dict of extra RolloutCallback init_args (e.g. {\"engine\": \"transformers\"})")
    parser.add_argument("--label", default="")
    parser.add_argument("--out")
    args = parser.parse_args()
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        runs.append(one_run(seed, args.max_steps, json.loads(args.model_args), json.loads(args.rollout_args)))
        print(json.dumps(runs[-1]), flush=True)
    result = {
        "benchmark": "quickstart", "label": args.label, "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(), "runs": runs,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
