"""The weight-sync boundary: one method, streaming named full tensors into the engine(s)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SyncReport:
    seconds: float
    bytes: int
    num_tensors: int


class WeightSync(ABC):
    """Pushes a trainer's weights into its engines. ``version`` counts the pushes that finished: the engines' weights
    are version 0 at start-up and ``n`` after the ``n``-th sync (each engine replica reports the one it serves)."""

    version: int = 0

    @abstractmethod
    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]], stable: bool = False) -> SyncReport:
        """Push every ``(hf_name, full_tensor)`` to the engine(s); return what it cost. ``stable``: each yielded tensor
        stays valid and unchanged until the sync ends (the trainer's own parameters), so a transport may send it from
        where it lies; False for a ZeRO-3 gather, whose tensors last only until the next one is requested."""


class GatherOnlySync(WeightSync):
    """For training ranks other than the sender: walk the parameters (under ZeRO-3 that takes part in
    the all-gathers rank 0 needs) and send nothing."""

    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]], stable: bool = False) -> SyncReport:
        for _ in named_params:
            pass
        return SyncReport(seconds=0.0, bytes=0, num_tensors=0)
