"""Fixtures of the verl integration tests (run by scripts/integrations/verl.sh, not by the main ``pytest``):
the quickstart's tiny Qwen3 as a ``save_pretrained`` directory, and the single-process setup verl's workers
expect from Ray and a GPU (a one-rank gloo group, a CPU platform: this machine has no GPU)."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the stand-in platform and shared constants, by module name


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's ~0.3M Qwen3, randomly initialised with seed 0, with the toy task's tokenizer plus a
    ``"\\n"`` token: verl's agent loop (``QwenContinuousTokenBuilder``, chosen by ``model_type: qwen3``) refuses
    a Qwen tokenizer in which the newline is not one token (the toy template itself has no newline)."""
    from arctic_rl.tasks.toy import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0, extra_tokens=("\n",))


def cpu_platform():
    """The test-only CPU platform (``verl_cpu_platform``): this machine has no GPU."""
    from verl_cpu_platform import CpuPlatform

    return CpuPlatform()


@pytest.fixture(scope="session")
def one_rank_group():
    """What Ray sets up for a verl worker: RANK/WORLD_SIZE/MASTER_* and a process group (gloo: verl's own
    ``initialize_global_process_group_ray`` would ask for NCCL, which the CPU build of torch lacks)."""
    import torch.distributed as dist
    from verl.plugin.platform.platform_manager import set_platform

    set_platform(cpu_platform())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
