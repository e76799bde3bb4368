"""Weight sync to an engine replica on another node of a Ray cluster, against a raw broadcast of the same bytes.

    python benchmarks/weight_sync_cluster.py --shape qwen3-0.6b --engines transformers,vllm --repeats 3

A local two-node cluster (``ray.cluster_utils.Cluster``): the head node has no CPUs, so every actor lands on
the second node, and this process (the sender, as training rank 0 is) stays off both. For each engine kind,
in one run:
- ``sync``: ``WeightSyncCoordinator.sync`` into one engine replica (``EnginePool``): the parameters in 256 MiB
  gloo buckets (a header, then one broadcast per tensor, sent from the model's own parameters: ``stable``), received
  straight into the transformers engine's parameters, or into buffers that vLLM then loads;
- ``raw``: a plain Ray actor on the same node joins a gloo group with this process, and the same bytes go as
  one ``broadcast`` per bucket into buffers it allocated beforehand: nothing else.
``ratio_stable`` and ``ratio_packed`` are raw seconds over sync seconds: the share of the bare transfer's throughput each sync keeps.
Prints one JSON object; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.weight_sync import SHAPES, build_model_dir, summarize, sync_params, write_result  # noqa: E402

BUCKET_BYTES = 256 << 20


class RawReceiver:
    """A Ray actor that receives broadcast buckets into buffers it holds, and does nothing with them."""

    def join(self, address, bucket_sizes: list[int]) -> int:
        from arctic_rl.weight_sync.broadcast import join_group

        self.timeout = address.timeout_s
        self.store, self.group = join_group(address, 1, torch.device("cpu"))
        self.buffers = [torch.empty(n, dtype=torch.uint8) for n in bucket_sizes]
        return len(self.buffers)

    def receive(self) -> int:
        from datetime import timedelta

        for buffer in self.buffers:
            self.group.broadcast(buffer, 0, timedelta(seconds=self.timeout)).wait()
        return sum(b.numel() for b in self.buffers)


def bucket_sizes(model: torch.nn.Module) -> list[int]:
    """The byte size of each bucket ``send_buckets`` makes of the model's parameters."""
    sizes, pending = [], 0
    for _, tensor in sync_params(model):
        size = tensor.numel() * tensor.element_size()
        if pending and pending + size > BUCKET_BYTES:
            sizes.append(pending)
            pending = 0
        pending += size
    return sizes + ([pending] if pending else [])


def bench_raw(model: torch.nn.Module, repeats: int) -> dict:
    import threading

    import ray

    from arctic_rl.weight_sync.base import SyncReport
    from arctic_rl.weight_sync.broadcast import GroupAddress, free_port, join_group

    sizes = bucket_sizes(model)
    address = GroupAddress("127.0.0.1", free_port(), 2, "gloo", 600.0)
    receiver = ray.remote(RawReceiver).options(num_cpus=1).remote()
    joined = receiver.join.remote(address, sizes)
    holder: list = []
    sender = threading.Thread(target=lambda: holder.append(join_group(address, 0, torch.device("cpu"))))
    sender.start()
    ray.get(joined)
    sender.join()
    _, group = holder[0]
    from datetime import timedelta

    buffers = [torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in chunk]) for chunk in _chunks(model, sizes)]
    reports = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        done = receiver.receive.remote()
        for buffer in buffers:
            group.broadcast(buffer, 0, timedelta(seconds=600)).wait()
        nbytes = ray.get(done)
        reports.append(SyncReport(time.perf_counter() - start, nbytes, len(buffers)))
    ray.kill(receiver)
    return {**summarize(reports[1:]), "first_s": round(reports[0].seconds, 3), "buckets": len(buffers)}


def _chunks(model: torch.nn.Module, sizes: list[int]) -> list[list[torch.Tensor]]:
    chunks, current, filled = [], [], 0
    for _, tensor in sync_params(model):
        current.append(tensor)
        filled += tensor.numel() * tensor.element_size()
        if filled == sizes[len(chunks)]:
            chunks.append(current)
            current, filled = [], 0
    return chunks


def bench_sync(model: torch.nn.Module, directory: str, dtype: str, engine: str, repeats: int) -> dict[str, dict]:
    """Both ways a sender sends: ``stable`` (its own parameters, sent where they lie) and ``packed`` (as under
    ZeRO-3: each tensor first copied into a bucket buffer), into the same replica."""
    from arctic_rl.rollout.engines.ray.pool import EnginePool
    from arctic_rl.weight_sync.coordinator import WeightSyncCoordinator

    pool = EnginePool(engine, directory, num_engines=1, dtype=dtype, max_model_len=512, num_cpus=1)
    try:
        sync = WeightSyncCoordinator(pool.actors, backend="gloo", bucket_bytes=BUCKET_BYTES, timeout_s=600)
        first = sync.sync(sync_params(model), stable=True)
        result = {}
        for name, stable in (("stable", True), ("packed", False)):
            reports = [sync.sync(sync_params(model), stable=stable) for _ in range(repeats)]
            result[name] = summarize(reports)
    finally:
        pool.shutdown()
    return {**result, "first_s_with_group_setup": round(first.seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--engines", default="transformers,vllm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import platform

    import ray
    from ray.cluster_utils import Cluster

    model, directory = build_model_dir(args.shape, args.dtype)
    result = {"shape": args.shape, "dtype": args.dtype, "params": sum(p.numel() for p in model.parameters()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "cluster": "ray.cluster_utils.Cluster: head (0 CPUs) + 1 node (2 CPUs), gloo over loopback",
              "date": time.strftime("%Y-%m-%d"), "bucket_mb": BUCKET_BYTES >> 20}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        for engine in args.engines.split(","):
            raw = bench_raw(model, args.repeats)  # measured beside each sync, so both see the same machine state
            synced = bench_sync(model, directory, args.dtype, engine, args.repeats)
            result[engine] = {"raw_broadcast": raw, "sync": synced,
                              **{f"ratio_{k}": round(raw["seconds_median"] / synced[k]["seconds_median"], 3)
                                 for k in ("stable", "packed")}}
            print({engine: result[engine]}, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    write_result(result, args.out)


if __name__ == "__main__":
    main()
