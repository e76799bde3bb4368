"""Multi-process DeepSpeed runs shared by the tests in this folder (launched once per session).

Each run is ``grpo_worker.py`` started as 1 or 2 real processes (``RANK``/``WORLD_SIZE``/``MASTER_*``,
gloo on CPU), forked from one process per rank that imported the worker's dependencies once for all the runs of a
fixture (``RankForks``, ``tests/rank_forks.py``). DeepSpeed's shm op is not built on CPU (``arctic_rl/patches/deepspeed.py``); an op DeepSpeed does
JIT-compile is cached in ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``, set for the whole suite in
``tests/conftest.py``), outside the repository.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from arctic_rl.weight_sync.broadcast import free_port

REPO = Path(__file__).resolve().parents[2]

WORKER = Path(__file__).with_name("grpo_worker.py")
# what a rank imports at its first use of DeepSpeed and of the Qwen3 model, ~2 s of CPU a rank: DeepSpeed's ZeRO
# optimizer check imports its Muon optimizer, whose module-level torch.compile imports torch._dynamo
PRELOAD = ("deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers.models.qwen3.modeling_qwen3")
STEPS, CHECKPOINT_EVERY, KILL_AT = 6, 2, 4  # the killed run dies while writing the step-4 checkpoint
LAUNCH_TIMEOUT_S = 300


@dataclass
class Run:
    out: Path
    returncodes: list[int]

    def metrics(self) -> list[dict]:
        with open(self.out / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]


class RankForks:
    """One ``tests/rank_forks.py`` process per rank (up to ``max_world_size``) for ``worker``, each having imported
    what the worker imports and the modules in ``preload``; ``launch`` starts a run's ranks as children of these, one
    from each, instead of as fresh interpreters that would each import torch, Lightning, transformers and DeepSpeed
    again. Use it as a context manager: it stops them at the end. ``errors``: a folder for the servers' own output."""

    def __init__(self, worker: Path, max_world_size: int, errors: Path, preload: tuple[str, ...] = ()) -> None:
        errors.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}  # 2 ranks on 2 cores
        self.servers = []
        for rank in range(max_world_size):
            with open(errors / f"rank_forks{rank}.err", "w") as err:
                self.servers.append(subprocess.Popen([sys.executable, "-m", "tests.rank_forks", str(worker), *preload], env=env,
                                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                     bufsize=0))
        self.received = [b""] * max_world_size  # what each server wrote that is not yet a whole answer
        self.errors = errors

    def __enter__(self) -> RankForks:
        return self

    def __exit__(self, *exc) -> None:
        for server in self.servers:  # the end of its requests ends it
            server.stdin.close()
        for server in self.servers:
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()

    def _answer(self, rank: int, deadline: float) -> dict | None:
        """The next answer of rank ``rank``'s server, or None if none came before ``deadline``."""
        fd = self.servers[rank].stdout.fileno()
        while b"\n" not in self.received[rank]:  # unbuffered reads: an answer already read is never waited for
            if not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
                return None
            data = os.read(fd, 4096)
            if not data:
                raise RuntimeError(f"rank server {rank} ended: {(self.errors / f'rank_forks{rank}.err').read_text()[-3000:]}")
            self.received[rank] += data
        line, self.received[rank] = self.received[rank].split(b"\n", 1)
        return json.loads(line)

    def _must_answer(self, rank: int, within_s: float) -> dict:
        answer = self._answer(rank, time.monotonic() + within_s)
        if answer is None:
            raise RuntimeError(f"rank server {rank} did not answer in {within_s} s")
        return answer

    def launch(self, out: Path, world_size: int, *args: str) -> Run:
        """Run the worker as ``world_size`` ranks (``RANK``/``WORLD_SIZE``/``MASTER_*``) with ``args``; wait for all;
        kill the rest if one hangs."""
        out.mkdir(parents=True, exist_ok=True)
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world_size), "NODE_RANK": "0"}
        for rank in range(world_size):
            request = {"argv": ["--out", str(out), *args], "env": {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                       "log": str(out / f"log_rank{rank}.txt")}
            self.servers[rank].stdin.write(json.dumps(request).encode() + b"\n")
        pids = [self._must_answer(rank, 60)["pid"] for rank in range(world_size)]
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        codes = []
        for rank in range(world_size):
            answer = self._answer(rank, deadline)
            if answer is None:  # a hang: stop every rank still running (our own children's children)
                for pid in pids[rank:]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                answer = self._must_answer(rank, 60)
            codes.append(answer["code"])
        return Run(out, codes)


def launch(out: Path, world_size: int, *args: str, worker: Path = WORKER) -> Run:
    """Run ``worker`` (``grpo_worker.py``) as ``world_size`` ranks; wait for all; kill the rest if one hangs."""
    with RankForks(worker, world_size, out / "rank_forks") as forks:
        return forks.launch(out, world_size, *args)


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
    with RankForks(WORKER, 2, root / "rank_forks", PRELOAD) as forks:  # every run's ranks, forked: the imports paid once per rank
        runs = {"baseline": forks.launch(root / "baseline", 1, *common, "--strategy", "auto")}
        runs["zero1"] = forks.launch(root / "zero1", 2, *common, "--strategy", "zero1")
        # ZoRRo token-budget micro-batches, prompt groups re-dealt over the 2 ranks by token load
        runs["zero2_tokens"] = forks.launch(root / "zero2_tokens", 2, *common, "--strategy", "zero2", "--micro-batch-tokens", "40")
        runs["zero1_sp2"] = forks.launch(root / "zero1_sp2", 2, *common, "--strategy", "zero1", "--sequence-parallel", "2")
        for stage in ("zero2", "zero3"):
            out = root / stage
            ckpt = ["--strategy", stage, "--checkpoint-every", str(CHECKPOINT_EVERY)]
            runs[f"{stage}_killed"] = forks.launch(out / "killed", 2, *common, *ckpt, "--kill-in-save-at-step", str(KILL_AT))
            last = out / "killed" / "checkpoints" / "last.ckpt"
            runs[f"{stage}_resumed"] = forks.launch(out / "resumed", 2, *common, *ckpt, "--resume", str(last))
    for name, run in runs.items():
        expected = [-9, -9] if name.endswith("_killed") else [0] * len(run.returncodes)
        assert run.returncodes == expected, f"{name} exited with {run.returncodes}:\n{_log_tail(run)}"
    return runs


@pytest.fixture(scope="module")
def one_rank_forks(tmp_path_factory):
    """One ``RankForks`` of ``grpo_worker.py`` for the 1-process runs of a test module."""
    with RankForks(WORKER, 1, tmp_path_factory.mktemp("rank_forks"), PRELOAD) as forks:
        yield forks


@pytest.fixture(scope="module", params=["zero1", "zero2"])
def lora_zero_runs(request, tmp_path_factory, toy_task, tiny_model_dir, one_rank_forks) -> dict[str, Run]:
    """LoRA (rank 4) under ZeRO-1 and ZeRO-2, 1 process: ``full`` (3 steps, every checkpoint kept: steps 2 and 3) and
    ``resumed`` (from ``full``'s step-2 checkpoint to step 3). A KL reference model rides along (frozen, like the base)."""
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    common = ["--task", str(toy_task), "--model", str(tiny_model_dir), "--steps", "3", "--kl-coef", "0.1",
              "--strategy", request.param, "--lora-rank", "4", "--checkpoint-every", "2"]
    runs = {"full": one_rank_forks.launch(root / "full", 1, *common, "--keep-checkpoints")}
    step2 = root / "full" / "checkpoints" / "epoch=0-step=2.ckpt"
    if step2.exists():
        runs["resumed"] = one_rank_forks.launch(root / "resumed", 1, *common, "--resume", str(step2))
    for name, run in runs.items():
        assert run.returncodes == [0], f"{name} exited with {run.returncodes}:\n{_log_tail(run)}"
    assert "resumed" in runs, f"no step-2 checkpoint in {root / 'full' / 'checkpoints'}"
    return runs
