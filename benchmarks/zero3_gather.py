"""The ZeRO-3 side of a weight sync: gathering the partitioned policy a bucket at a time
(``arctic_rl.strategies.zero.gather_in_buckets``, what ``GRPOModule.named_parameters_for_sync`` runs).

Every rank builds the model under ``deepspeed.zero.Init`` (bf16, partitioned as it is built; values are
left as initialised, the timing does not depend on them) and walks every parameter plus the tied head, as
a sync does. Rank 0 also touches each yielded tensor (a sum) as a sender would read it. Real DeepSpeed,
real gloo ranks on this machine.

    DS_ACCELERATOR=cpu python benchmarks/zero3_gather.py --shape qwen3-1.7b --ranks 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch
import torch.multiprocessing as mp

from arctic_rl.weight_sync.base import SyncReport
from arctic_rl.weight_sync.broadcast import free_port
from weight_sync import SHAPES, summarize, write_result  # benchmarks/weight_sync.py, beside this script

def rank_main(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM

    from arctic_rl.strategies.zero import gather_in_buckets

    config = AutoConfig.for_model(model_type="qwen3", tie_word_embeddings=True, max_position_embeddings=512, **SHAPES[args.shape])
    ds_config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1}
    with deepspeed.zero.Init(config_dict_or_path=ds_config, dtype=torch.bfloat16):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    named = list(net.named_parameters())
    named.insert(1, ("lm_head.weight", net.lm_head.weight))  # tied: as named_parameters_for_sync yields it
    times, nbytes = [], 0
    for _ in range(args.repeats + 1):
        torch.distributed.barrier()
        start, nbytes, check = time.perf_counter(), 0, 0.0
        for _, tensor in gather_in_buckets(named, args.bucket_mb << 20):
            nbytes += tensor.numel() * tensor.element_size()
            if rank == 0:
                check += float(tensor.float().sum())
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        results.put({"times": times, "bytes": nbytes, "tensors": len(named)})
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--out")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, results)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    out = results.get(timeout=3600)
    for p in procs:
        p.join(120)
    reports = [SyncReport(t, out["bytes"], out["tensors"]) for t in out["times"][1:]]
    result = {"shape": args.shape, "ranks": args.ranks, "bucket_mb": args.bucket_mb, **summarize(reports),
              "first_s": round(out["times"][0], 3),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
              "date": time.strftime("%Y-%m-%d")}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
