"""Shared fixtures: a tiny Qwen3 and the toy task's tokenizer, built offline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
from arctic_rl.rollout.engines.vllm.env import apply_vllm_env_defaults  # noqa: E402  (light: no torch, no vLLM)

apply_vllm_env_defaults()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from arctic_rl.tasks.toy import build_tokenizer, tiny_qwen3_config, write_task


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def toy_task(tmp_path_factory):
    """The toy task's directory: ``tokenizer/``, ``train.jsonl``, ``val.jsonl``."""
    return write_task(tmp_path_factory.mktemp("toy"), num_train=64, num_val=8)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A ``save_pretrained`` directory of a seeded random tiny Qwen3 plus the toy tokenizer."""
    from arctic_rl.modules.models import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(tiny_qwen3_config(len(tokenizer)), "float32")
    out = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def quickstart_cli_run(tmp_path_factory, toy_task):
    """One real ``python -m arctic_rl.cli fit`` of the quickstart (6 steps, a checkpoint every 3) in a fresh
    ``$TMPDIR``, shared by the run-lifecycle and reproducibility tests: ``(root, config path, finished process)``."""
    from tests.helpers import cli_in, quickstart_cli_config, write_config

    root = tmp_path_factory.mktemp("quickstart_cli")
    (root / "tmp").mkdir()
    path = write_config(quickstart_cli_config(toy_task, root), root / "c.yaml")
    proc = cli_in(["fit", "--config", str(path)], root, root / "tmp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, path, proc
