"""Weight sync over a dedicated torch.distributed group joining the trainer's sender (rank 0) and one
receiver per engine (ranks 1..E): gloo on CPU, NCCL on GPU, the same code.

The group is its own ``TCPStore`` + ``ProcessGroupGloo``/``ProcessGroupNCCL``, independent of the
trainer's default group; the store only forms it. Parameters stream in buckets, each a header and one
broadcast per tensor over the group, in order: the header is its metadata's length and its metadata (the sync id,
then each tensor's name, shape and dtype, pickled). The sender broadcasts its own parameters where they lie (or, for
a ZeRO-3 gather, views of one packed buffer); a receiver receives each tensor straight into its engine's parameter
where the engine offers one (``ReceivesInPlace``), or into a buffer of the bucket's own, and hands them to its engine
lazily, so neither side ever holds more than one bucket beyond the model. A length of 0 ends the sync. Every wait
has a timeout; the coordinator names the engine that did not answer.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable, Iterator
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


def serve_store(host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The sender's store, listening on a port the system picks (``store.port``): no other process can take that port
    between choosing it and listening on it, as with a port found free beforehand."""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def join_group(address: GroupAddress, rank: int, device: torch.device,
               store: dist.TCPStore | None = None) -> tuple[dist.Store, dist.ProcessGroup | None]:
    """Connect to the sender's store (rank 0 may pass its own, from :func:`serve_store`) and build the process group
    (blocks until all ranks joined); ``cuda_ipc`` needs only the store (no group: None)."""
    timeout = timedelta(seconds=address.timeout_s)
    if store is None:
        store = dist.TCPStore(address.host, address.port, address.world_size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
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


def _header(metas: list[TensorMeta] | None, sync_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A bucket's metadata as two tensors on ``device`` (NCCL broadcasts device tensors only): its length ``[1]``
    (0: the sync's end, no metadata follows) and its pickled ``(sync_id, metas)`` bytes."""
    if metas is None:
        return torch.zeros(1, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.uint8, device=device)
    data = torch.frombuffer(bytearray(pickle.dumps((sync_id, metas))), dtype=torch.uint8).to(device)
    return torch.tensor([data.numel()], dtype=torch.int64, device=device), data


class SendBuffers:
    """The sender's two bucket buffers, kept across syncs (no new allocation, no page faults per sync): one is
    broadcast while the next bucket is packed into the other."""

    def __init__(self) -> None:
        self._slots: list[torch.Tensor | None] = [None, None]

    def get(self, slot: int, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._slots[slot]
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel or buffer.device != device:
            buffer = self._slots[slot] = torch.empty(numel, dtype=dtype, device=device)
        return buffer


def send_buckets(
    group: dist.ProcessGroup,
    sync_id: int,
    named_params: Iterator[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    device: torch.device,
    timeout_s: float,
    buffers: SendBuffers | None = None,
    stable: bool = False,
) -> tuple[int, int]:
    """Rank 0: broadcast every parameter, in buckets of at most ``bucket_bytes`` (one tensor larger than that goes
    alone; a dtype change starts a new bucket): the bucket's header, then one broadcast per tensor, so a receiver may
    receive each tensor straight into its own storage.

    ``stable``: each yielded tensor stays valid until the sync ends (the trainer's own parameters), so it is broadcast
    from where it lies, with no copy. Otherwise (a ZeRO-3 gather, valid only until the next tensor is requested) each
    tensor is copied once, into the bucket's buffer (two buffers, ``buffers`` to keep them across syncs), and a bucket
    is packed while the one before it is on the wire. Returns ``(bytes, tensors)`` sent."""
    buffers = buffers or SendBuffers()
    timeout = timedelta(seconds=timeout_s)
    total_bytes, count, bucket_id = 0, 0, 0
    in_flight: list = [None, None]  # each slot's broadcasts and the tensors they send, until they are done
    metas: list[TensorMeta] = []
    tensors: list[torch.Tensor] = []  # what each broadcast of the bucket sends: the tensor itself, or its packed view
    buffer: torch.Tensor | None = None
    bucket_numel, bucket_dtype = 0, None

    def post_header(bucket_metas: list[TensorMeta] | None) -> tuple[list, tuple[torch.Tensor, ...]]:
        """Broadcast a bucket's metadata length and metadata: the works, and the tensors they send (kept until done)."""
        length, data = _header(bucket_metas, sync_id, device)
        works = [group.broadcast(length, 0, timeout)]
        if data.numel():
            works.append(group.broadcast(data, 0, timeout))
        return works, (length, data)

    def wait(slot: int) -> None:
        if in_flight[slot] is not None:
            for work in in_flight[slot][0]:
                work.wait()
            in_flight[slot] = None

    def flush() -> None:
        nonlocal bucket_id, metas, tensors, buffer, bucket_numel, bucket_dtype
        slot = bucket_id % 2
        if stable:
            wait(slot)  # at most two buckets on the wire
        works, kept = post_header(metas)
        works.extend(group.broadcast(t, 0, timeout) for t in tensors)
        in_flight[slot] = (works, kept, tensors)
        bucket_id, metas, tensors, buffer, bucket_numel, bucket_dtype = bucket_id + 1, [], [], None, 0, None

    for name, tensor in named_params:
        numel = tensor.numel()
        if metas and ((bucket_numel + numel) * tensor.element_size() > bucket_bytes or tensor.dtype != bucket_dtype):
            flush()
        source = tensor.detach()
        if stable:
            source = source.contiguous()  # a copy only for a non-contiguous tensor
        else:
            if buffer is None:
                slot = bucket_id % 2
                wait(slot)  # the bucket two back is sent: its buffer is free
                buffer = buffers.get(slot, tensor.dtype, max(bucket_bytes // tensor.element_size(), numel), device)
            packed = buffer[bucket_numel : bucket_numel + numel]
            packed.copy_(source.reshape(-1))  # the one copy; a yielded ZeRO-3 gather is valid only until the next
            source = packed
        metas.append(TensorMeta(name, tuple(tensor.shape), tensor.dtype))
        tensors.append(source)
        bucket_numel, bucket_dtype = bucket_numel + numel, tensor.dtype
        total_bytes += numel * tensor.element_size()
        count += 1
    if metas:
        flush()
    end_works, end_tensors = post_header(None)  # the tensors stay referenced until their broadcast is done
    for slot in (0, 1):
        wait(slot)
    for work in end_works:
        work.wait()
    return total_bytes, count


Target = Callable[[str], "torch.Tensor | None"]  # a weight's name -> the engine's tensor to receive it into


def receive_buckets(
    group: dist.ProcessGroup, sync_id: int, device: torch.device, timeout_s: float, target: Target | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..E: yield ``(name, tensor)`` as buckets arrive, until the sender's end marker. ``target`` may give, for
    a weight's name, the engine's own tensor to receive it into (same shape, dtype and device, contiguous): it is then
    received in place and yielded as itself, with nothing left to copy. Other tensors are received into a buffer of
    their bucket's own (an engine may keep the views it was given until the end of the sync). The next bucket is
    already being received while the engine loads this one's tensors."""
    timeout = timedelta(seconds=timeout_s)

    def destination(meta: TensorMeta) -> torch.Tensor | None:
        into = target(meta.name) if target is not None else None
        if into is None:
            return None
        if tuple(into.shape) != meta.shape or into.dtype != meta.dtype or into.device != device or not into.is_contiguous():
            return None
        return into

    def post(bucket_id: int):
        length = torch.zeros(1, dtype=torch.int64, device=device)
        group.broadcast(length, 0, timeout).wait()
        if int(length.item()) == 0:
            return None
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        group.broadcast(data, 0, timeout).wait()
        sent_for, metas = pickle.loads(data.cpu().numpy().tobytes())
        if sent_for != sync_id:
            raise RuntimeError(f"weight sync {sync_id}: bucket {bucket_id} of the sender's sync {sent_for} arrived")
        intos = [destination(m) for m in metas]
        rest = sum(int(torch.Size(m.shape).numel()) for m, into in zip(metas, intos) if into is None)
        buffer = torch.empty(rest, dtype=metas[0].dtype, device=device) if rest else None
        tensors, offset = [], 0
        for m, into in zip(metas, intos):
            if into is None:
                n = int(torch.Size(m.shape).numel())
                into, offset = buffer[offset : offset + n].view(m.shape), offset + n
            tensors.append(into)
        return metas, tensors, [group.broadcast(t, 0, timeout) for t in tensors]

    bucket_id, current = 0, post(0)
    while current is not None:
        metas, tensors, works = current
        for work in works:
            work.wait()
        bucket_id += 1
        current = post(bucket_id)  # the sender packs the next bucket while this one travelled: receive it meanwhile
        for m, tensor in zip(metas, tensors):
            yield m.name, tensor
