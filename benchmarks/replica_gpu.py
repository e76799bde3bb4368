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
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from overlap_gpu import SHAPES, alternate_runs, fit_trainer, report, run_fit, step_summary, workload_arguments  # noqa: E402

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
    summary = step_summary(events, rows, seconds, ("timing/rollout_s", "timing/train_s", "timing/sync_s", "sampler_logprob_diff"))
    return {"mode": mode, "run": name, **summary, "reward": [round(r["reward"], 4) for r in rows]}


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    args = parser.parse_args()
    runs = alternate_runs(args, {mode: (lambda tmp, run, tokenizer, data, mode=mode: one_run(tmp, run, mode, args, tokenizer, data))
                                 for mode in MODES})
    report({"command": " ".join(sys.argv), "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "shape": args.shape, "torch": torch.__version__, "runs": runs}, args.out)

if __name__ == "__main__":
    main()
