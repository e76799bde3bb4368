"""Fixtures of the verl integration tests (run by scripts/integrations/verl.sh, not by the main ``pytest``):
the quickstart's tiny Qwen3 as a ``save_pretrained`` directory, and the single-process setup verl's workers
expect from Ray and a GPU (a one-rank gloo group, a CPU platform: this machine has no GPU)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The quickstart's ~0.3M Qwen3, randomly initialised with seed 0, with the toy task's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from arctic_rl.tasks.toy import build_tokenizer, tiny_qwen3_config

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = build_tokenizer()
    config = tiny_qwen3_config(len(tokenizer))
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


class _CpuMemory:
    """``torch.cuda``'s memory/sync calls verl's workers make, answered for the CPU (no accelerator here)."""

    @staticmethod
    def max_memory_allocated(*args):
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def get_device_name(*args):
        return "cpu"  # unknown to verl's FLOPS table: mfu is 0

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def synchronize(*args):
        pass


def cpu_platform():
    """A test-only verl platform for this GPU-less machine (verl 0.9.1 registers only nvidia, huawei and amd,
    and falls back to CUDA): device ``cpu``, gloo, no-op memory statistics. Not ours: a stand-in for the GPU."""
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    class CpuPlatform(PlatformCUDA):
        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def device_module(self):
            return _CpuMemory

        def is_available(self) -> bool:
            return True

        def synchronize(self, device_index=None) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

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
