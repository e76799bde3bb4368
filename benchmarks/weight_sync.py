"""Weight-sync throughput: trainer parameters -> a real vLLM engine, end to end (copy or broadcast,
and vLLM's in-place reload), for the transports that run on this machine.

    python benchmarks/weight_sync.py --shape qwen3-1.7b --transports inprocess,gloo --repeats 3

``inprocess``: an engine in the trainer's process (``InProcessWeightSync``). ``gloo``: an engine in a
Ray actor, parameters broadcast over a dedicated gloo group in 256 MiB buckets
(``WeightSyncCoordinator``); the first sync, which also forms the group, is reported apart.
``cuda_ipc`` (GPU): a transformers engine in another process on the trainer's GPU, fed through CUDA
IPC handles of two rotating 256 MiB buffers (``IpcSender``); ``nccl`` (2 GPUs): the same engine on
GPU 1, parameters broadcast over a dedicated NCCL group in 256 MiB buckets. First syncs apart.
Prints one JSON object; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

SHAPES = {
    # Qwen3-1.7B: 28 layers, hidden 2048, 16 query / 8 kv heads of 128, MLP 6144, vocab 151,936, tied
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 query / 8 kv heads of 128, MLP 3072, vocab 151,936, tied
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=64),
}


def build_model_dir(shape: str, dtype: str) -> tuple[torch.nn.Module, str]:
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.tasks.toy import build_tokenizer

    torch.manual_seed(0)
    config = {"model_type": "qwen3", "max_position_embeddings": 512, "tie_word_embeddings": True, **SHAPES[shape]}
    model = build_causal_lm(config, dtype)
    directory = tempfile.mkdtemp(prefix="arctic-rl-bench-")
    model.save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return model, directory


def sync_params(model: torch.nn.Module):
    return iter(list(model.named_parameters()) + [("lm_head.weight", model.lm_head.weight)])


def bench_inprocess(model, directory: str, dtype: str, repeats: int, engine_kind: str = "vllm", device: str = "cpu") -> dict:
    from arctic_rl.weight_sync import InProcessWeightSync

    if engine_kind == "vllm":
        from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

        engine = VLLMEngine(directory, dtype=dtype, max_model_len=512)
    else:
        from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

        engine = TransformersEngine(directory, dtype=dtype, device=device)
    try:
        sync = InProcessWeightSync(engine)
        reports = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            reports.append(sync.sync(sync_params(model)))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
    finally:
        engine.shutdown()
    return summarize(reports)


def bench_gloo(model, directory: str, dtype: str, repeats: int) -> dict:
    import ray

    from arctic_rl.rollout.engines.ray.pool import EnginePool
    from arctic_rl.weight_sync.coordinator import WeightSyncCoordinator

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pool = EnginePool("vllm", directory, num_engines=1, dtype=dtype, max_model_len=512, num_cpus=1)
        sync = WeightSyncCoordinator(pool.actors, backend="gloo", timeout_s=600)
        first = sync.sync(sync_params(model))
        reports = [sync.sync(sync_params(model)) for _ in range(repeats)]
        pool.shutdown()
    finally:
        ray.shutdown()
    return {**summarize(reports), "first_sync_s_with_group_setup": round(first.seconds, 3)}


def _engine_process(directory: str, dtype: str, address, device: str, syncs: int, done) -> None:
    """The receiving engine: a TransformersEngine in its own process on ``device``, fed by ``cuda_ipc``
    (same GPU as the trainer) or ``nccl`` (another GPU)."""
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
    from arctic_rl.weight_sync.broadcast import join_group, receive_buckets
    from arctic_rl.weight_sync.cuda_ipc import receive_ipc

    device = torch.device(device)
    torch.cuda.set_device(device)
    engine = TransformersEngine(directory, dtype=dtype, device=str(device))
    store, group = join_group(address, 1, device)
    done.put("ready")
    for sync_id in range(1, syncs + 1):
        if address.backend == "cuda_ipc":
            engine.update_weights(receive_ipc(store, 1, sync_id, device))
        else:
            engine.update_weights(receive_buckets(group, sync_id, device, address.timeout_s))
        torch.cuda.synchronize(device)
        done.put(sync_id)


def bench_gpu_transport(model, directory: str, dtype: str, repeats: int, backend: str, bucket_mb: int = 256) -> dict:
    """Trainer (this process, GPU 0) -> an engine process: ``cuda_ipc`` into a colocated engine on GPU 0
    (``IpcSender``), or ``nccl`` broadcast to an engine on GPU 1 (``send_buckets``);
    ``WeightSyncCoordinator`` runs the same code with Ray actors. A sync ends when the engine has loaded
    every tensor (IPC: acknowledged every bucket; NCCL: reported the sync done)."""
    import torch.multiprocessing as mp

    from arctic_rl.weight_sync.base import SyncReport
    from arctic_rl.weight_sync.broadcast import GroupAddress, free_port, join_group, send_buckets
    from arctic_rl.weight_sync.cuda_ipc import IpcSender

    address = GroupAddress("127.0.0.1", free_port(), 2, backend, 300.0)
    engine_device = "cuda:0" if backend == "cuda_ipc" else "cuda:1"
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    engine = ctx.Process(target=_engine_process, args=(directory, dtype, address, engine_device, repeats + 1, done))
    engine.start()
    sender_device = torch.device("cuda", 0)
    store, group = join_group(address, 0, sender_device)
    assert done.get(timeout=300) == "ready"
    ipc = IpcSender(store, 1, sender_device, bucket_mb << 20, 300.0) if backend == "cuda_ipc" else None
    reports = []
    for sync_id in range(1, repeats + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if ipc is not None:
            nbytes, count = ipc.send(sync_id, sync_params(model))
        else:
            nbytes, count = send_buckets(group, sync_id, sync_params(model), bucket_mb << 20, sender_device, 300.0)
        assert done.get(timeout=300) == sync_id
        reports.append(SyncReport(time.perf_counter() - start, nbytes, count))
    engine.join(60)
    return {**summarize(reports[1:]), "first_sync_s": round(reports[0].seconds, 4), "bucket_mb": bucket_mb,
            "engine_device": engine_device}


def summarize(reports) -> dict:
    seconds = sorted(r.seconds for r in reports)
    median = seconds[len(seconds) // 2]
    return {"seconds_median": round(median, 3), "seconds_all": [round(s, 3) for s in seconds],
            "gbytes": round(reports[0].bytes / 1e9, 3), "gbytes_per_s": round(reports[0].bytes / 1e9 / median, 3),
            "tensors": reports[0].num_tensors}


def write_result(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``out`` when given."""
    print(json.dumps(result, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--transports", default="inprocess,gloo")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", choices=["vllm", "transformers"], default="vllm", help="receiver of inprocess")
    parser.add_argument("--device", default="cpu", help="where the trainer's model (and a transformers engine) live")
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    started = time.perf_counter()
    model, directory = build_model_dir(args.shape, args.dtype)
    model.to(args.device)
    result = {"shape": args.shape, "dtype": args.dtype, "params": sum(p.numel() for p in model.parameters()),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
              + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
              "engine": args.engine, "device": args.device,
              "date": time.strftime("%Y-%m-%d"), "setup_s": round(time.perf_counter() - started, 1)}
    for transport in args.transports.split(","):
        if transport == "inprocess":
            result[transport] = bench_inprocess(model, directory, args.dtype, args.repeats, args.engine, args.device)
        elif transport == "gloo":
            result[transport] = bench_gloo(model, directory, args.dtype, args.repeats)
        elif transport in ("cuda_ipc", "nccl"):
            result[transport] = bench_gpu_transport(model, directory, args.dtype, args.repeats, transport)
        else:
            raise SystemExit(f"unknown transport {transport!r}: inprocess, gloo, cuda_ipc or nccl")
        print(json.dumps({transport: result[transport]}), flush=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
