"""``WeightSyncCoordinator``: streams the trainer's parameters to every engine actor after a step,
over a torch.distributed broadcast group (gloo on CPU, NCCL on GPU) or, for engines on the trainer's
own GPU, through CUDA IPC handles (``cuda_ipc.py``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import torch

from arctic_rl.weight_sync.base import SyncReport, WeightSync
from arctic_rl.weight_sync.broadcast import GroupAddress, SendBuffers, join_group, send_buckets, serve_store


class EngineNotResponding(RuntimeError):
    """An engine did not join or finish a weight sync within the timeout."""


class WeightSyncCoordinator(WeightSync):
    """The sender (trainer rank 0) plus engine actors ``engines`` (ranks 1..; a tensor-parallel vLLM
    engine takes one rank per worker, each worker receiving the full tensors and loading its shard).

    Setup is lazy (first :meth:`sync`) and thread-safe. Each sync starts ``receive_weights`` on every
    engine, broadcasts the buckets, then waits for every engine's answer; an engine that does not answer
    within ``timeout_s`` raises :class:`EngineNotResponding` naming it, never a silent hang.

    Args:
        engines: Ray actor handles of :class:`~arctic_rl.rollout.engines.ray.actor.EngineActor`.
        backend: ``gloo`` (CPU tensors), ``nccl`` (CUDA tensors, engines on other GPUs or nodes) or
            ``cuda_ipc`` (engines colocated on the trainer's GPU ``device``: they map its buffers).
        bucket_bytes: largest broadcast buffer (for ``cuda_ipc``: each of the two shared buffers).
        timeout_s: for joining, each collective and each engine's answer.
        host: address engines reach the sender's store at (this node's IP on a multi-node cluster).
    """

    def __init__(self, engines: list, backend: str = "gloo", bucket_bytes: int = 256 << 20, timeout_s: float = 120.0,
                 host: str = "127.0.0.1", device: str = "cpu") -> None:
        self.engines, self.backend, self.bucket_bytes, self.timeout_s = list(engines), backend, bucket_bytes, timeout_s
        self.host, self.device = host, torch.device(device)
        self._lock = threading.Lock()
        if backend not in ("gloo", "nccl", "cuda_ipc"):
            raise ValueError(f"weight-sync backend must be 'gloo', 'nccl' or 'cuda_ipc', got {backend!r}")
        if backend == "cuda_ipc" and self.device.type != "cuda":
            raise ValueError(f"backend 'cuda_ipc' shares GPU memory: device must be a CUDA device, got {device!r}")
        self._store = self._group = self._ipc = None
        self._send_buffers = SendBuffers()  # the two bucket buffers, kept across syncs
        self._sync_id = 0

    def _engine_name(self, i: int) -> str:
        return f"engine {i} (actor {self.engines[i]._actor_id.hex()[:12]})"

    def _wait_all(self, refs: list, what: str) -> list:
        """``ray.get`` each engine's ref within the timeout; name the first that fails or is late."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except ray.exceptions.GetTimeoutError:
                raise EngineNotResponding(f"{self._engine_name(i)} did not {what} within {self.timeout_s:.0f}s") from None
            except ray.exceptions.RayActorError as e:
                raise EngineNotResponding(f"{self._engine_name(i)} died while trying to {what}: {e}") from e
        return results

    def _setup(self) -> None:
        # each engine takes one rank per receiving worker (a tensor-parallel vLLM engine: one per TP rank)
        sizes = self._wait_all([engine.num_weight_receivers.remote() for engine in self.engines], "report its workers")
        self._receivers = sum(sizes)
        store = serve_store(self.host, 1 + self._receivers, self.timeout_s)  # listening before any engine is told where
        address = GroupAddress(self.host, store.port, 1 + self._receivers, self.backend, self.timeout_s)
        base_ranks = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        joins = [engine.join_weight_group.remote(address, rank) for rank, engine in zip(base_ranks, self.engines)]
        setup_error: list[BaseException] = []

        def join_as_sender() -> None:
            try:
                self._store, self._group = join_group(address, 0, self.device, store)
            except BaseException as e:  # reported below, with the engine that is missing
                setup_error.append(e)

        sender = threading.Thread(target=join_as_sender, daemon=True)
        sender.start()
        self._wait_all(joins, "join the weight-sync group")
        sender.join(self.timeout_s)
        if setup_error or self._store is None:
            raise EngineNotResponding(f"weight-sync group did not form: {setup_error[0] if setup_error else 'timeout'}")
        if self.backend == "cuda_ipc":
            from arctic_rl.weight_sync.cuda_ipc import IpcSender

            self._ipc = IpcSender(self._store, self._receivers, self.device, self.bucket_bytes, self.timeout_s)

    def sync(self, named_params: Iterator[tuple[str, torch.Tensor]], stable: bool = False) -> SyncReport:
        with self._lock:
            start = time.perf_counter()
            if self._store is None:
                self._setup()
            self._sync_id += 1
            receives = [engine.receive_weights.remote(self._sync_id) for engine in self.engines]
            try:
                if self._ipc is not None:
                    nbytes, count = self._ipc.send(self._sync_id, named_params)
                else:
                    nbytes, count = send_buckets(self._group, self._sync_id, named_params, self.bucket_bytes,
                                                 self.device, self.timeout_s, self._send_buffers, stable=stable)
            except RuntimeError as e:  # a collective or a store wait failed or timed out: find out which engine is gone
                self._group = self._store = self._ipc = None  # the group is broken; the next sync forms a new one
                self._wait_all(receives, "receive weights")
                raise EngineNotResponding(f"weight broadcast failed: {e}") from e
            loaded = self._wait_all(receives, "finish receiving weights")
            for i, n in enumerate(loaded):
                if n != count:
                    raise RuntimeError(f"{self._engine_name(i)} loaded {n} tensors, the trainer sent {count}")
            self.version = self._sync_id  # every engine now serves sync ``_sync_id`` (``EngineActor.receive_weights``)
            return SyncReport(seconds=time.perf_counter() - start, bytes=nbytes, num_tensors=count)
