"""The GSM8K recipe's config at its real shape on one GPU, through ``arctic-rl fit``: Qwen3-1.7B shape
(random weights: no hub here), G=8, 32 prompts a step, 1024 prompt / 1024 response tokens, ArcticStrategy
ZeRO-3, bf16, ZoRRo flex, gradient checkpointing. Two changes, for this machine only: the transformers
engine (vLLM is not installed on it) and a CSV logger (no W&B). The prompts are the recipe's fixture
problems (prepared with ``arctic-rl prepare gsm8k``) repeated to fill a batch, tokenized by a word-level
tokenizer over the model's vocabulary (random weights do not need Qwen's).

    python benchmarks/recipe_gsm8k_gpu.py --steps 1 --out gsm8k_step.json

Prints (and writes) the run's per-step timing metrics, the wall time of the whole ``fit``, and where its start-up
goes (``quickstart.StepClock``, the first callback, stamps each phase): ``launch_to_setup`` (interpreter, imports,
config, the module's construction), ``setup_to_fit_start`` (the strategy's setup: process group, DeepSpeed, the
model's build, the optimizer), ``fit_start_to_train_start`` (checkpoint restore, the loop's start), ``engine_start``
(``train_start`` to the first batch: the other callbacks' ``on_train_start``, the rollout engine's start among
them), ``first_step`` (its rollout with the CUDA-graph captures, the self-check, the first compile) and
``launch_to_first_step`` (launch to the first step's start).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QWEN3_1_7B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
              "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": True}


def word_tokenizer(vocab_size: int, out: Path) -> Path:
    """Word-level, one word per id (the first ids are the toy task's words and specials), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from arctic_rl.tasks.toy import CHAT_TEMPLATE, DIGITS, FILLER, SPECIAL

    words = SPECIAL + DIGITS + FILLER
    vocab = {w: i for i, w in enumerate(words)} | {f"w{i}": i for i in range(len(words), vocab_size)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def startup_split(events: list[dict], launched: float) -> dict[str, float]:
    """Seconds of each start-up phase from ``StepClock``'s stamps (see the module docstring)."""
    first = {}
    for e in events:
        first.setdefault(e["event"], e["t"])
    t = {"launch": launched, **first}
    phases = [("launch_to_setup", "launch", "setup"), ("setup_to_fit_start", "setup", "fit_start"),
              ("fit_start_to_train_start", "fit_start", "train_start"), ("engine_start", "train_start", "batch_start"),
              ("first_step", "batch_start", "batch_end"), ("launch_to_first_step", "launch", "batch_start")]
    return {name: round(t[b] - t[a], 2) for name, a, b in phases if a in t and b in t}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "arctic_rl.cli", "prepare", "gsm8k", "--source",
                        str(ROOT / "tests/recipes/fixtures/gsm8k"), "--out", str(tmp / "data")], check=True, cwd=ROOT)
        rows = (tmp / "data/train.jsonl").read_text().splitlines()
        (tmp / "data/train.jsonl").write_text("\n".join((rows * 64)[:64]) + "\n")
        config = yaml.safe_load((ROOT / "recipes/gsm8k/qwen3_1.7b.yaml").read_text())
        config["model"]["init_args"].update(model=QWEN3_1_7B, tokenizer=str(word_tokenizer(151936, tmp / "tokenizer")))
        config["data"]["init_args"]["train_path"] = str(tmp / "data/train.jsonl")
        trainer = config["trainer"]
        trainer.update(max_steps=args.steps, default_root_dir=str(tmp / "run"))
        trainer["logger"] = [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp / "run"), "name": "logs"}}]
        clock = tmp / "clock.jsonl"
        trainer["callbacks"] = [{"class_path": "quickstart.StepClock", "init_args": {"path": str(clock)}},
                                {"class_path": "arctic_rl.RolloutCallback", "init_args": {"engine": "transformers"}}]
        (tmp / "config.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        launched, started = time.time(), time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(tmp / "config.yaml")], cwd=ROOT,
                              capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-6000:])
            raise SystemExit(done.returncode)
        with open(next((tmp / "run/logs").glob("version_*/metrics.csv"))) as f:
            metrics = [{k: v for k, v in row.items() if v} for row in csv.DictReader(f)]
        startup = startup_split([json.loads(line) for line in clock.read_text().splitlines()], launched)
    keep = ("timing/rollout_s", "timing/train_s", "timing/sync_s", "response_length/mean", "zorro/dedup_ratio",
            "tokens_per_s", "reward", "grad_norm", "step")
    steps = [{k: float(v) for k, v in row.items() if k in keep} for row in metrics if "timing/train_s" in row]
    result = {"command": " ".join(sys.argv), "fit_wall_s": wall, "startup": startup, "steps": steps,
              "summary": done.stdout.strip().splitlines()[-1:]}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
