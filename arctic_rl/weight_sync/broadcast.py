"""Weight sync over a dedicated torch.distributed group joining the trainer's sender (rank 0) and one
receiver per engine (ranks 1..E): gloo on CPU, NCCL on GPU, the same code.

The group is its own ``TCPStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL``, independent of the
trainer's default group. Parameters stream in buckets: for each bucket the sender publishes its
metadata (names, shapes, dtypes) under a key in the store and broadcasts one flat buffer; receivers
read the key, receive the buffer and hand views of it to their engine lazily, so neither side ever
holds more than one bucket beyond the model. A ``None`` metadata ends the sync. Every wait has a
timeout; the coordinator names the engine that did not answer.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupAddress:
    """Where receivers find the group: the sender's store, and the group's size."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo", "nccl" or "cuda_ipc" (store only, no process group: ``cuda_ipc.py``)
    timeout_s: float


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_group(address: GroupAddress, rank: int, device: torch.device) -> tuple[dist.Store, dist.ProcessGroup | None]:
    """Connect to the sender's store and build the process group (blocks until all ranks joined);
    ``cuda_ipc`` needs only the store (no group: None)."""
    timeout = timedelta(seconds=address.timeout_s)
    store = dist.TCPStore(address.host, address.port, address.world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("arctic-rl-weight-sync", store)
    if address.backend == "cuda_ipc":
        return prefixed, None
    if address.backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, address.world_size, timeout)
    elif address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        group = dist.ProcessGroupNCCL(prefixed, rank, address.world_size, options)
    else:
        raise ValueError(f"weight-sync backend must be 'gloo', 'nccl' or 'cuda_ipc', got {address.backend!r}")
    return store, group


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _bucket_key(sync_id: int, bucket: int) -> str:
    return f"sync{sync_id}/bucket{bucket}"


def send_buckets(
    store: dist.TCPStore,
    group: dist.ProcessGroup,
    sync_id: int,
    named_params: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device,
    timeout_s: float,
) -> tuple[int, int]:
    """Rank 0: broadcast every parameter in buckets of at most ``bucket_bytes`` (one tensor larger
    than that goes alone). All tensors of a bucket must share a dtype; a dtype change starts a new
    bucket. Returns ``(bytes, tensors)`` sent."""
    total_bytes, count, bucket_id = 0, 0, 0
    pending: list[tuple[str, torch.Tensor]] = []

    def flush() -> None:
        nonlocal bucket_id, pending
        metas = [TensorMeta(n, tuple(t.shape), t.dtype) for n, t in pending]
        buffer = torch.cat([t.reshape(-1) for _, t in pending])
        store.set(_bucket_key(sync_id, bucket_id), pickle.dumps(metas))
        group.broadcast(buffer, 0, timedelta(seconds=timeout_s)).wait()
        bucket_id, pending = bucket_id + 1, []

    pending_bytes = 0
    for name, tensor in named_params:
        size = tensor.numel() * tensor.element_size()
        if pending and (pending_bytes + size > bucket_bytes or tensor.dtype != pending[0][1].dtype):
            flush()
            pending_bytes = 0
        pending.append((name, tensor.detach().to(device, copy=True)))  # a yielded ZeRO-3 gather is valid only until the next
        pending_bytes += size
        total_bytes += size
        count += 1
    if pending:
        flush()
    store.set(_bucket_key(sync_id, bucket_id), pickle.dumps(None))
    return total_bytes, count


def receive_buckets(
    store: dist.TCPStore, group: dist.ProcessGroup, sync_id: int, device: torch.device, timeout_s: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..E: yield ``(name, tensor)`` as buckets arrive, until the sender's end marker."""
    bucket_id = 0
    while True:
        metas: list[TensorMeta] | None = pickle.loads(store.get(_bucket_key(sync_id, bucket_id)))
        if metas is None:
            return
        numel = sum(int(torch.Size(m.shape).numel()) for m in metas)
        buffer = torch.empty(numel, dtype=metas[0].dtype, device=device)
        group.broadcast(buffer, 0, timedelta(seconds=timeout_s)).wait()
        offset = 0
        for m in metas:
            n = int(torch.Size(m.shape).numel())
            yield m.name, buffer[offset : offset + n].view(m.shape)
            offset += n
        bucket_id += 1
