"""Weight sync into engines on the trainer's own GPU (colocated) through CUDA IPC: no copy over a wire.

The sender packs parameters into one of two persistent device buffers (a tensor larger than a buffer
is shared as itself), synchronizes its stream, and publishes the buffer's IPC handle with the
tensors' names, dtypes, shapes and byte offsets under a key in the coordinator's ``TCPStore``.
Each receiver maps the buffer (torch caches the mapping, so each persistent buffer is opened once per
process), hands views of it to its engine, which copies them into its weights, synchronizes, and
acknowledges the bucket under its own key. The sender refills a buffer only after every receiver
acknowledged it, so two buckets are in flight: one being read while the next is packed.

Handles are made and opened with ``torch.multiprocessing.reductions`` (the CUDA IPC path of
``torch.multiprocessing``). Every wait has the coordinator's timeout.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

ALIGN = 256  # byte alignment of each tensor inside a bucket (any dtype's view is then aligned)


@dataclass(frozen=True)
class IpcTensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the shared buffer


def _key(sync_id: int, bucket: int) -> str:
    return f"ipc{sync_id}/bucket{bucket}"


def _ack_key(sync_id: int, bucket: int, rank: int) -> str:
    return f"ipc{sync_id}/bucket{bucket}/ack{rank}"


def gpu_uuid(device: torch.device) -> str:
    """The physical GPU behind ``device`` (indices differ between processes with other CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class IpcSender:
    """Rank 0 of a CUDA-IPC weight sync: owns the two bucket buffers across syncs."""

    def __init__(self, store: dist.Store, num_receivers: int, device: torch.device, bucket_bytes: int,
                 timeout_s: float) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA IPC weight sync needs a CUDA device, got {device}")
        self.store, self.num_receivers, self.device = store, num_receivers, device
        self.bucket_bytes, self.timeout = bucket_bytes, timedelta(seconds=timeout_s)
        self._buffers: list[torch.Tensor | None] = [None, None]

    def _buffer(self, slot: int) -> torch.Tensor:
        if self._buffers[slot] is None:
            self._buffers[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def _wait_acks(self, sync_id: int, bucket: int) -> None:
        keys = [_ack_key(sync_id, bucket, rank) for rank in range(1, 1 + self.num_receivers)]
        self.store.wait(keys, self.timeout)
        for key in keys + [_key(sync_id, bucket)]:
            self.store.delete_key(key)

    def _publish(self, sync_id: int, bucket: int, shared: torch.Tensor, metas: list[IpcTensorMeta]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.current_stream(self.device).synchronize()  # the bytes are in place before anyone reads
        rebuild, args = reduce_tensor(shared)
        self.store.set(_key(sync_id, bucket), pickle.dumps((gpu_uuid(self.device), rebuild, args, metas)))

    def send(self, sync_id: int, named_params: Iterator[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Share every parameter with the receivers; returns ``(bytes, tensors)``. Each yielded tensor is
        copied (or, if larger than a buffer, shared and waited for) before the iterator advances, so a
        ZeRO-3 gather that is valid only until the next item is safe."""
        total, count, bucket = 0, 0, 0
        metas: list[IpcTensorMeta] = []
        fill = 0
        in_flight: list[int] = []  # published buckets not yet acknowledged, oldest first

        def reserve_slot() -> None:  # before packing into bucket's slot, the bucket two back must be done
            if len(in_flight) == 2:
                self._wait_acks(sync_id, in_flight.pop(0))

        def flush() -> None:
            nonlocal bucket, metas, fill
            self._publish(sync_id, bucket, self._buffer(bucket % 2)[:fill], metas)
            in_flight.append(bucket)
            bucket, metas, fill = bucket + 1, [], 0

        for name, tensor in named_params:
            tensor = tensor.detach()
            if tensor.device != self.device:
                raise ValueError(f"parameter {name!r} is on {tensor.device}; CUDA IPC sync shares {self.device} memory")
            size = tensor.numel() * tensor.element_size()
            total, count = total + size, count + 1
            if size > self.bucket_bytes:  # shared as itself; wait for it before the iterator moves on
                if metas:
                    flush()
                whole = _as_bytes(tensor.contiguous())  # held (a copy, if it was strided) until acknowledged
                self._publish(sync_id, bucket, whole, [IpcTensorMeta(name, tuple(tensor.shape), tensor.dtype, 0)])
                in_flight.append(bucket)
                bucket += 1
                while in_flight:
                    self._wait_acks(sync_id, in_flight.pop(0))
                del whole
                continue
            if metas and fill + size > self.bucket_bytes:
                flush()
            if not metas:
                reserve_slot()
            self._buffer(bucket % 2)[fill : fill + size].copy_(_as_bytes(tensor))
            metas.append(IpcTensorMeta(name, tuple(tensor.shape), tensor.dtype, fill))
            fill += -(-size // ALIGN) * ALIGN
        if metas:
            flush()
        self.store.set(_key(sync_id, bucket), pickle.dumps(None))
        while in_flight:
            self._wait_acks(sync_id, in_flight.pop(0))
        return total, count


def receive_ipc(store: dist.Store, rank: int, sync_id: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..E: yield ``(name, tensor)`` views of the sender's buffers as buckets are published; each
    bucket is acknowledged once the consumer asked for the item after its last tensor (it must have
    copied what it was given by then) and the device has finished those copies."""
    bucket = 0
    while True:
        message = pickle.loads(store.get(_key(sync_id, bucket)))
        if message is None:
            return
        sender_gpu, rebuild, args, metas = message
        if sender_gpu != gpu_uuid(device):
            raise RuntimeError(
                f"CUDA IPC weight sync: this engine is on GPU {gpu_uuid(device)}, the trainer's buffers on GPU {sender_gpu}; "
                "cuda_ipc needs every engine colocated on the sending trainer's GPU (use 'nccl' otherwise)"
            )
        shared = rebuild(*args)
        for m in metas:
            size = int(torch.Size(m.shape).numel()) * m.dtype.itemsize
            yield m.name, shared[m.offset : m.offset + size].view(m.dtype).view(m.shape)
        del shared
        torch.cuda.synchronize(device)
        store.set(_ack_key(sync_id, bucket, rank), b"1")
        bucket += 1
