"""Weight sync to an engine living in the trainer's process: tensors streamed straight into it."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch

from arctic_rl.weight_sync.base import SyncReport, WeightSync


class WeightLoader(Protocol):
    """What an in-process sync writes into: the one method of ``rollout.engines.base.RolloutEngine`` it calls
    (declared here, so weight sync needs nothing from the rollout package above it)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load every weight (full tensors, Hugging Face names) from one, possibly lazy, iterator."""


class InProcessWeightSync(WeightSync):
    """Streams parameters into ``engine.update_weights`` as one lazy iterator: each tensor is copied
    (the engine must not alias trainer memory) only when the engine asks for it, so peak extra memory
    is what the engine itself buffers, not a second model. One call per sync, because vLLM's in-place
    reload treats every call as the complete set of weights."""

    def __init__(self, engine: WeightLoader) -> None:
        self.engine = engine

    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]], stable: bool = False) -> SyncReport:
        start, counts = time.perf_counter(), {"bytes": 0, "tensors": 0}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named_params:
                counts["bytes"] += tensor.numel() * tensor.element_size()
                counts["tensors"] += 1
                yield name, tensor.detach().clone()

        self.engine.update_weights(stream())
        self.version += 1
        return SyncReport(seconds=time.perf_counter() - start, bytes=counts["bytes"], num_tensors=counts["tensors"])
