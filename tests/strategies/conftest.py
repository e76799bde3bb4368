"""Multi-process DeepSpeed runs shared by the tests in this folder (launched once per session).

Each run is ``grpo_worker.py`` started as 1 or 2 real processes (``RANK``/``WORLD_SIZE``/``MASTER_*``,
gloo on CPU). DeepSpeed's shm op is not built on CPU (``arctic_rl/patches/deepspeed.py``); an op DeepSpeed does
JIT-compile is cached in ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``, set for the whole suite in
``tests/conftest.py``), outside the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from arctic_rl.weight_sync.broadcast import free_port

WORKER = Path(__file__).with_name("grpo_worker.py")
STEPS, CHECKPOINT_EVERY, KILL_AT = 6, 2, 4  # the killed run dies while writing the step-4 checkpoint
LAUNCH_TIMEOUT_S = 300


@dataclass
class Run:
    out: Path
    returncodes: list[int]

    def metrics(self) -> list[dict]:
        with open(self.out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]


def launch(out: Path, world_size: int, *args: str, worker: Path = WORKER) -> Run:
    """Run ``worker`` (``grpo_worker.py``) as ``world_size`` ranks; wait for all; kill the rest if one hangs."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "NODE_RANK": "0",
        "OMP_NUM_THREADS": "1",  # 2 ranks on 2 cores
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
    }
    procs = []
    for rank in range(world_size):
        log = open(out / f"log_rank{rank}.txt", "a")
        cmd = [sys.executable, str(worker), "--out", str(out), *args]
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:  # only our own children, and only if still running (a hang)
            if p.poll() is None:
                p.kill()
                p.wait()
    return Run(out, codes)


def _log_tail(run: Run) -> str:
    return "\n".join((run.out / f"log_rank{r}.txt").read_text()[-3000:] for r in range(len(run.returncodes)))


@pytest.fixture(scope="session")
def schedule() -> dict[str, int]:
    """Steps of every run, checkpoint interval, and the step whose checkpoint write is killed."""
    return {"steps": STEPS, "checkpoint_every": CHECKPOINT_EVERY, "kill_at": KILL_AT}


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory, toy_task, tiny_model_dir) -> dict[str, Run]:
    """``baseline`` (1 process, default strategy, uninterrupted); for ``zero2`` and ``zero3`` (2 processes):
    ``<stage>_killed`` (SIGKILLed while writing the step-4 checkpoint) and ``<stage>_resumed`` (resumed
    from its ``last.ckpt``, i.e. step 2, to the end); ``zero1`` (2 processes, uninterrupted);
    ``zero2_tokens`` (2 processes, ZoRRo token-budget micro-batches balanced across the ranks); ``zero1_sp2`` (2
    processes, ``compute.sequence_parallel: 2``: one group computing both ranks' shares, each packed row split)."""
    root = tmp_path_factory.mktemp("ds_runs")
    # kl_coef > 0: every run also carries the reference model (partitioned under ZeRO-3), mixed with the policy
    # after every optimizer step (TRL's sync_ref_model; inside the rollout batch and at its end);
    # 2 mini-batches: 2 optimizer steps per rollout batch (the second one off-policy)
    common = ["--task", str(toy_task), "--model", str(tiny_model_dir), "--steps", str(STEPS), "--kl-coef", "0.1",
              "--mini-batches", "2", "--prompts", "8", "--sync-ref-model-steps", "1"]
    runs = {"baseline": launch(root / "baseline", 1, *common, "--strategy", "auto")}
    runs["zero1"] = launch(root / "zero1", 2, *common, "--strategy", "zero1")
    # ZoRRo token-budget micro-batches, prompt groups re-dealt over the 2 ranks by token load
    runs["zero2_tokens"] = launch(root / "zero2_tokens", 2, *common, "--strategy", "zero2", "--micro-batch-tokens", "40")
    runs["zero1_sp2"] = launch(root / "zero1_sp2", 2, *common, "--strategy", "zero1", "--sequence-parallel", "2")
    for stage in ("zero2", "zero3"):
        out = root / stage
        ckpt = ["--strategy", stage, "--checkpoint-every", str(CHECKPOINT_EVERY)]
        runs[f"{stage}_killed"] = launch(out / "killed", 2, *common, *ckpt, "--kill-in-save-at-step", str(KILL_AT))
        last = out / "killed" / "checkpoints" / "last.ckpt"
        runs[f"{stage}_resumed"] = launch(out / "resumed", 2, *common, *ckpt, "--resume", str(last))
    for name, run in runs.items():
        expected = [-9, -9] if name.endswith("_killed") else [0] * len(run.returncodes)
        assert run.returncodes == expected, f"{name} exited with {run.returncodes}:\n{_log_tail(run)}"
    return runs


@pytest.fixture(scope="module", params=["zero1", "zero2"])
def lora_zero_runs(request, tmp_path_factory, toy_task, tiny_model_dir) -> dict[str, Run]:
    """LoRA (rank 4) under ZeRO-1 and ZeRO-2, 1 process: ``full`` (3 steps, every checkpoint kept: steps 2 and 3) and
    ``resumed`` (from ``full``'s step-2 checkpoint to step 3). A KL reference model rides along (frozen, like the base)."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    common = ["--task", str(toy_task), "--model", str(tiny_model_dir), "--steps", "3", "--kl-coef", "0.1",
              "--strategy", request.param, "--lora-rank", "4", "--checkpoint-every", "2"]
    runs = {"full": launch(root / "full", 1, *common, "--keep-checkpoints")}
    step2 = root / "full" / "checkpoints" / "epoch=0-step=2.ckpt"
    if step2.exists():
        runs["resumed"] = launch(root / "resumed", 1, *common, "--resume", str(step2))
    for name, run in runs.items():
        assert run.returncodes == [0], f"{name} exited with {run.returncodes}:\n{_log_tail(run)}"
    assert "resumed" in runs, f"no step-2 checkpoint in {root / 'full' / 'checkpoints'}"
    return runs
