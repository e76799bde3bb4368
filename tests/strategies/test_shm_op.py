"""DeepSpeed's CPU process group starts without its JIT-built shm op (``arctic_rl/patches/deepspeed.py``): its only user
is ``inference_all_reduce``; training's collectives go through torch.distributed either way."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

deepspeed_torch_comm = pytest.importorskip("deepspeed.comm.torch")


def test_cpu_process_group_starts_without_the_shm_op(monkeypatch):
    from arctic_rl.patches.deepspeed import skip_shm_comm_op
    from arctic_rl.weight_sync.broadcast import free_port

    monkeypatch.setattr(deepspeed_torch_comm, "build_shm_op", deepspeed_torch_comm.build_shm_op)  # restored after
    skip_shm_comm_op()
    assert deepspeed_torch_comm.build_shm_op() is None
    backend = deepspeed_torch_comm.TorchBackend("gloo", timedelta(seconds=60), f"tcp://127.0.0.1:{free_port()}",
                                                rank=0, world_size=1)
    try:
        assert backend.shm_comm_op is None and not hasattr(backend, "shm_vector_kernel_level")
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
