"""Weight sync to an engine living in the trainer's process: buckets of tensors handed over directly."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from arctic_rl.rollout.engine import RolloutEngine
from arctic_rl.weight_sync.base import SyncReport, WeightSync


class InProcessWeightSync(WeightSync):
    """Copies parameters into ``engine`` in buckets of at most ``bucket_bytes`` (a tensor larger than
    a bucket goes alone), so peak extra memory is one bucket of detached copies."""

    def __init__(self, engine: RolloutEngine, bucket_bytes: int = 256 << 20) -> None:
        self.engine, self.bucket_bytes = engine, bucket_bytes

    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        start, total, count = time.perf_counter(), 0, 0
        bucket: list[tuple[str, torch.Tensor]] = []
        bucket_size = 0
        for name, tensor in named_params:
            size = tensor.numel() * tensor.element_size()
            if bucket and bucket_size + size > self.bucket_bytes:
                self.engine.update_weights(bucket)
                bucket, bucket_size = [], 0
            bucket.append((name, tensor.detach().clone()))  # the engine must not alias trainer memory
            bucket_size += size
            total += size
            count += 1
        if bucket:
            self.engine.update_weights(bucket)
        return SyncReport(seconds=time.perf_counter() - start, bytes=total, num_tensors=count)
