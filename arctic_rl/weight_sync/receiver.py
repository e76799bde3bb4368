"""``WeightReceiver``: one receiving rank of the weight-sync group (an engine actor, or one vLLM
worker of a tensor-parallel engine): joins the coordinator's group, then hands each sync's tensors
to a loader as they arrive, over the group's transport (broadcast buckets, or CUDA IPC handles)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from arctic_rl.weight_sync.broadcast import GroupAddress, Target, join_group, receive_buckets

Loader = Callable[[Iterator[tuple[str, torch.Tensor]]], Any]


@dataclass
class WeightReceiver:
    address: GroupAddress
    rank: int
    device: torch.device
    store: Any
    group: Any  # None for cuda_ipc (store only)

    @staticmethod
    def join(address: GroupAddress, rank: int, device: torch.device) -> "WeightReceiver":
        """Join as ``rank`` (blocks until every member has joined)."""
        store, group = join_group(address, rank, device)
        return WeightReceiver(address, rank, device, store, group)

    def receive(self, sync_id: int, load: Loader, target: Target | None = None) -> int:
        """Feed sync ``sync_id``'s ``(name, tensor)`` stream to ``load``; returns the tensors loaded. ``target``: the
        engine's own tensor for a weight, to broadcast it straight into (``receive_buckets``)."""
        if self.address.backend == "cuda_ipc":
            from arctic_rl.weight_sync.cuda_ipc import receive_ipc

            items = receive_ipc(self.store, self.rank, sync_id, self.device)
        else:
            items = receive_buckets(self.group, sync_id, self.device, self.address.timeout_s, target)
        count = 0

        def counted():
            nonlocal count
            for item in items:
                count += 1
                yield item

        load(counted())
        return count
