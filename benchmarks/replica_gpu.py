"""The rollout engine as a Ray replica actor of its own, colocated on the training GPU, against today's engine inside
the training process, through ``arctic-rl fit`` on one GPU, in one run (the cluster backend's single-GPU layout).

    python benchmarks/replica_gpu.py --steps 8 --repeats 2 --out replica_gpu.json
    python benchmarks/replica_gpu.py --accelerator cpu --shape tiny --steps 4 --repeats 1   # a CPU smoke run

Both modes: a Qwen3-0.6B-shaped policy (random weights), bf16, the transformers engine, the toy echo task with long
filler prompts, ``max_staleness: 0``. ``inprocess``: the engine in the training process, put to sleep while training
runs, its weights copied in place (``InProcessWeightSync``). ``replica``: one ``EngineActor`` in a Ray actor of its own
on the same GPU (``num_gpus_per_engine`` below 1), asleep while training runs, its weights pushed through CUDA IPC
(``weight_sync_backend: cuda_ipc``; gloo on CPU), received into its parameters. Each mode runs in a fresh process, the
modes alternating (``--repeats``); reported per run as ``benchmarks/overlap_gpu.py`` reports them: the median step and
the medians of ``timing/rollout_s``, ``timing/train_s`` and ``timing/sync_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from overlap_gpu import QWEN3_0_6B, SHAPES, fit_trainer, run_fit, write_data  # noqa: E402

MODES = ("inprocess", "replica")


def callback(mode: str, accelerator: str) -> dict:
    settings = {"engine": "transformers", "max_staleness": 0, "log_samples_every_n_steps": 0}
    if mode == "inprocess":
        return {**settings, "engine_kwargs": {"device": "cuda:0" if accelerator == "gpu" else "cpu"}}
    gpu = accelerator == "gpu"
    return {**settings, "ray": {"num_engines": 1, "num_cpus_per_engine": 1, "num_gpus_per_engine": 0.4 if gpu else 0,
                                "weight_sync_backend": "cuda_ipc" if gpu else "gloo", "timeout_s": 600}}


def one_run(tmp: Path, name: str, mode: str, args, tokenizer: Path, data: Path) -> dict:
    clock = tmp / f"{name}.clock.jsonl"
    config = {
        "seed_everything": 0,
        "model": {"class_path": "arctic_rl.tasks.toy.EchoDigitGRPO", "init_args": {
            "model": SHAPES[args.shape], "tokenizer": str(tokenizer), "dtype": "bfloat16" if args.accelerator == "gpu" else "float32",
            "sampling": {"group_size": args.group_size, "max_prompt_length": args.prompt_words + 8,
                         "max_response_length": args.response_tokens},
            "optim": {"learning_rate": 1e-6},
            "compute": {"micro_batch_size": args.micro_batch_size, "gradient_checkpointing": True, "self_check": False}}},
        "data": {"class_path": "arctic_rl.PromptDataModule", "init_args": {"train_path": str(data), "batch_size": args.prompts}},
        "trainer": fit_trainer(tmp, name, args.accelerator, "bf16-true" if args.accelerator == "gpu" else "32-true",
                               args.steps, callback(mode, args.accelerator), clock),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    events, rows, seconds = run_fit(tmp, name, path, clock)
    starts = [e["t"] for e in events if e["event"] == "batch_start"]

    def median(key: str) -> float | None:
        values = [r[key] for r in rows[1:] if key in r]  # the first step warms up
        return round(statistics.median(values), 4) if values else None

    return {"mode": mode, "run": name, "wall_s": round(seconds, 1),
            "step_s_median": round(statistics.median(b - a for a, b in zip(starts[1:], starts[2:])), 4),
            **{key.split("/")[-1]: median(key) for key in ("timing/rollout_s", "timing/train_s", "timing/sync_s")},
            "sampler_logprob_diff": median("sampler_logprob_diff"), "reward": [round(r["reward"], 4) for r in rows]}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args()
    from recipe_gsm8k_gpu import word_tokenizer

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tokenizer = word_tokenizer(QWEN3_0_6B["vocab_size"], tmp / "tokenizer")
        data = write_data(tmp / "train.jsonl", args.prompt_words, 16 * args.prompts)
        for r in range(args.repeats):
            for mode in MODES:
                runs.append(one_run(tmp, f"{mode}{r}", mode, args, tokenizer, data))
                print(json.dumps(runs[-1]), flush=True)
    result = {"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "shape": args.shape, "torch": torch.__version__, "runs": runs}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
