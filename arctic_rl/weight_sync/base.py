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
    @abstractmethod
    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]]) -> SyncReport:
        """Push every ``(hf_name, full_tensor)`` to the engine(s); return what it cost."""
