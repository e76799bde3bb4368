"""Ulysses sequence parallelism under ZoRRo (``arctic_rl/zorro/sequence_parallel.py``) over real gloo ranks: the
log-probs, entropies, loss and gradients of a batch split over the ranks equal the single-rank run's.

One spawn of 4 ranks serves every case (rank start-up is the cost): the 2-rank cases run on its two groups of 2
consecutive ranks, the 4-rank ones on the whole world; ``sp_worker.py`` is the rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arctic_rl.weight_sync.broadcast import free_port
from arctic_rl.zorro.logprobs import resolve_backend
from arctic_rl.zorro.sequence_parallel import SequenceParallel, SequenceParallelError
from tests.zorro.models import build_tiny

WORKER = Path(__file__).with_name("sp_worker.py")
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "bfloat16": 3e-2}
TWO_RANK_CASES = [
    "2:qwen3:float64:group", "2:qwen3:float32:group", "2:llama:float64:group", "2:llama:float32:group",
    "2:qwen3:float64:tree",  # the prefix tree: shared response prefixes computed once, across the split
    "2:qwen2:float64:group",  # layer 1 has a sliding window (4) shorter than the prompts
    "2:gpt_oss:float64:group",  # alternating windowed / full layers with per-head attention sinks (split with the heads)
]
# 4 ranks: 1 query head each, the 2 key/value heads repeated (split_kv_heads); the group and tree layouts
FOUR_RANK_CASES = ["4:qwen3:float64:group", "4:llama:float32:group", "4:qwen3:float64:tree",
                   "4:qwen3:float64:long"]  # ranks 0 and 1 hold inner prompt rows only: no target of their own
# the flex backend's block masks over the exchanged row, eager FlexAttention forward (no CPU backward: GPU_CASES)
FLEX_CPU_CASES = ["2:qwen3:float64:group:flex", "4:qwen3:float64:tree:flex"]


def spawn(world: int, cases: list[str], out: Path, **env: str) -> dict:
    port, repo = str(free_port()), str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    logs = [open(out.with_suffix(f".rank{r}.log"), "w") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, str(out), *cases], env=env,
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:  # our own children, only if one hung
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world, [out.with_suffix(f".rank{r}.log").read_text()[-3000:] for r in range(world)]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return spawn(4, TWO_RANK_CASES + FOUR_RANK_CASES + FLEX_CPU_CASES, tmp_path_factory.mktemp("sp") / "results.json")


def assert_equal_to_single_rank(result: dict, dtype: str, gradients: bool = True) -> None:
    tol = TOLERANCE[dtype]
    assert result["nonzero_logprobs"] > 0  # the comparisons below are not vacuous
    assert result["logprobs"] <= tol and result["entropy"] <= tol and result["loss"] <= tol * 10
    if gradients:
        assert result["grad_scale"] > 0.1
        assert result["grads"] <= tol * max(1.0, result["grad_scale"])
        assert result["rank_grad_share"] > 1e-3  # one rank's gradient alone is a part, not the whole: the split is real


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks_equal_the_single_rank_run(results, case):
    assert_equal_to_single_rank(results[case], case.split(":")[2])


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_four_ranks_equal_the_single_rank_run(results, case):
    assert_equal_to_single_rank(results[case], case.split(":")[2])
    if case.endswith(":group"):
        assert results[case]["rows_per_rank"] == 6  # 23 tokens padded to 24
    if case.endswith(":long"):
        assert results[case]["rows_per_rank"] == 10  # 30 + 3 + (2+2) + 2 = 39 tokens padded to 40


def test_two_ranks_each_run_half_the_packed_row(results):
    # the batch packs 5 + (4+2+3) and 3 + (5+1) = 23 tokens, padded to 24: each rank's decoder sees 12 rows
    assert {results[case]["rows_per_rank"] for case in TWO_RANK_CASES if case.endswith(":group")} == {12}


def test_query_heads_must_split_evenly():
    model = build_tiny("qwen3")  # 4 query heads, 2 key/value heads
    SequenceParallel(None, 4, 0).check_model(model)
    with pytest.raises(SequenceParallelError, match=r"sequence_parallel=3 .* 4 query heads: not a multiple of 3"):
        SequenceParallel(None, 3, 1).check_model(model)


def test_fewer_key_value_heads_than_ranks_are_repeated_in_their_groups():
    kv = torch.arange(2.0).view(1, 2, 1, 1)  # heads 0 and 1; 4 query heads read 0, 0, 1, 1
    assert SequenceParallel(None, 4, 0).split_kv_heads(kv).flatten().tolist() == [0, 0, 1, 1]
    assert SequenceParallel(None, 2, 0).split_kv_heads(kv) is kv


@pytest.mark.parametrize("case", FLEX_CPU_CASES)
def test_flex_under_the_split_equals_the_single_rank_run(results, case):
    assert results[case]["backend"] == "flex"
    assert_equal_to_single_rank(results[case], "float64", gradients=False)


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_the_split_keeps_the_backend(backend):
    assert resolve_backend(backend, torch.device("cpu")) == backend
    assert resolve_backend("auto", torch.device("cuda")) == "flex"


# every backend the packed row runs on, with gradients: flex (block masks; a windowed family; the tree), and the
# cascade kernels (bf16: the fused kernels' dtype; both runs of a case on the same kernel)
GPU_CASES = ["2:qwen3:float32:group:flex", "2:qwen3:float32:tree:flex", "2:qwen2:float32:group:flex",
             "2:qwen3:bfloat16:group:cudnn", "2:llama:bfloat16:group:cudnn", "2:qwen3:bfloat16:group:flash_varlen",
             "2:qwen3:float32:group:sdpa"]


@pytest.mark.gpu
def test_gpu_backends_equal_the_single_rank_run(tmp_path):
    """Two ranks on one GPU (gloo, the exchange through host memory): each backend split equals its own single-rank run."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    results = spawn(2, GPU_CASES, tmp_path / "results.json", SP_DEVICE="cuda_shared")
    for case in GPU_CASES:
        assert results[case]["backend"] == case.split(":")[4]
        assert_equal_to_single_rank(results[case], case.split(":")[2])


@pytest.mark.gpu
def test_two_gpus_over_nccl_equal_the_single_rank_run(tmp_path):
    """The same exchange over NCCL, each rank on its own GPU."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = spawn(2, GPU_CASES, tmp_path / "results.json", SP_DEVICE="cuda")
    for case in GPU_CASES:
        assert_equal_to_single_rank(results[case], case.split(":")[2])
