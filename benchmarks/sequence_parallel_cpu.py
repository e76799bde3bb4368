"""Ulysses sequence parallelism on CPU: ZoRRo's packed forward+backward split over 2 and 4 gloo ranks against one rank
at the same tokens (``arctic_rl/zorro/sequence_parallel.py``; the exactness is ``tests/zorro/test_sequence_parallel.py``).

Every degree runs in its own processes (degree 1: one process, no process group), each rank started like
``tests/zorro/sp_worker.py`` starts its ranks. A rank builds the same seeded Qwen3 (random weights, float32, ``sdpa``) and
the same packed GRPO batch, runs ``--warmup`` steps, then ``--iters`` timed forward+backward steps
(``zorro_response_logprobs`` + a loss reaching every log-prob and entropy + ``backward``). A step's time is the
slowest rank's (barrier before, max over the ranks after). The exchange time is the time spent inside the
all-to-alls (``sequence_parallel.all_to_all``, forward and backward), summed per step, the slowest rank's; it
includes waiting for the other ranks to arrive, so load imbalance shows up there too. The log-prob all-gather is not
counted in it.

Threads: the total is held at ``--threads`` (default 2): degree 1 runs ``--threads`` torch threads, degree ``N``
``max(1, threads // N)`` per rank (so on 2 threads, degree 4 runs 4 single-threaded ranks: over-subscribed; the
table says how many threads each degree ran in all).

    python benchmarks/sequence_parallel_cpu.py --out sp_cpu.json        # about 45 s on 2 quiet cores
    python benchmarks/sequence_parallel_cpu.py --iters 1 --warmup 0 --responses 2 --prompt 64 --response 32   # smoke, ~40 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.prompt + args.response,
        tie_word_embeddings=True, attention_dropout=0.0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def build_batch(args):
    import torch

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, args.vocab, (args.prompt,), generator=gen).tolist() for _ in range(args.prompts)]
    rows = args.prompts * args.responses
    ids = torch.randint(1, args.vocab, (rows, args.response), generator=gen)
    mask = torch.ones(rows, args.response)
    return [prompts[i // args.responses] for i in range(rows)], ids, mask


def worker(rank: int, world: int, port: str, out: str, args) -> None:
    """One rank: ``world`` ranks share the packed row (``world == 1``: the single-rank run, no process group)."""
    import torch
    import torch.distributed as dist

    import arctic_rl.zorro.sequence_parallel as sequence_parallel
    from arctic_rl.zorro import zorro_response_logprobs
    from arctic_rl.zorro.sequence_parallel import SequenceParallel

    torch.set_num_threads(max(1, args.threads // world))
    sp = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        sp = SequenceParallel(None, world, rank)
    exchange = [0.0]
    exchange_fn = sequence_parallel.all_to_all

    def timed_all_to_all(*a):  # the module-level function both directions of _AllToAll call
        started = time.perf_counter()
        result = exchange_fn(*a)
        exchange[0] += time.perf_counter() - started
        return result

    sequence_parallel.all_to_all = timed_all_to_all
    model = build_model(args)
    prompts, ids, mask = build_batch(args)
    rows_seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: rows_seen.append(a[0].shape[-1]))
    steps, exchanges = [], []
    for step in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        exchange[0] = 0.0
        if sp:
            dist.barrier()
        started = time.perf_counter()
        logprobs, entropy = zorro_response_logprobs(model, prompts, ids, mask, 1.0, True, 0, attention_backend="sdpa",
                                                    dedup="group", sequence_parallel=sp)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel()).view_as(logprobs)
        ((logprobs * weights).sum() + 0.3 * (entropy * mask).sum()).backward()
        took = torch.tensor([time.perf_counter() - started, exchange[0]], dtype=torch.float64)
        if sp:
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= args.warmup:
            steps.append(took[0].item())
            exchanges.append(took[1].item())
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": steps, "exchange_s": exchanges, "tokens_per_rank": rows_seen[0]}))
    if sp:
        dist.destroy_process_group()


def spawn(world: int, args, passthrough: list[str]) -> dict:
    from arctic_rl.weight_sync.broadcast import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out, port = Path(tmp) / "out.json", str(free_port())
        per_rank = str(max(1, args.threads // world))
        env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": per_rank}
        logs = [open(Path(tmp) / f"rank{r}.log", "w") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), port, str(out), *passthrough],
                                  env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:  # our own children, only if one hung
                if p.poll() is None:
                    p.kill()
        if codes != [0] * world:
            tails = [(Path(tmp) / f"rank{r}.log").read_text()[-2000:] for r in range(world)]
            raise SystemExit(f"degree {world} failed {codes}:\n" + "\n".join(tails))
        return json.loads(out.read_text())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--degrees", default="1,2,4", help="sequence-parallel degrees, comma-separated (1 is the baseline)")
    p.add_argument("--threads", type=int, default=2, help="torch threads in all, per degree")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--responses", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--response", type=int, default=128, help="response tokens")
    p.add_argument("--timeout", type=int, default=300, help="seconds a degree's ranks may take")
    p.add_argument("--out", type=Path, help="write the JSON summary here")
    return p


def table(summary: dict) -> str:
    lines = ["| SP degree | ranks x threads | tokens per rank | fwd+bwd s (median) | all-to-all s | speed-up vs SP 1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in summary["results"]:
        lines.append(f"| {row['degree']} | {row['degree']} x {row['threads_per_rank']} | {row['tokens_per_rank']} | "
                     f"{row['step_s']:.3f} | {row['exchange_s']:.3f} | {row['speedup']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, port, out = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
        worker(rank, world, port, out, parser().parse_args(sys.argv[6:]))
        return
    args = parser().parse_args()
    passthrough = sys.argv[1:]  # the workers parse the same options (and leave --out alone)
    degrees = [int(d) for d in args.degrees.split(",")]
    if args.heads % max(degrees):
        raise SystemExit(f"--heads {args.heads} must divide by every degree in --degrees {args.degrees}")
    started = time.perf_counter()
    results = []
    for degree in degrees:
        run = spawn(degree, args, passthrough)
        results.append({"degree": degree, "threads_per_rank": max(1, args.threads // degree),
                        "tokens_per_rank": run["tokens_per_rank"], "step_s": statistics.median(run["step_s"]),
                        "exchange_s": statistics.median(run["exchange_s"]), "step_s_all": run["step_s"],
                        "exchange_s_all": run["exchange_s"]})
    base = next((r["step_s"] for r in results if r["degree"] == 1), None)
    for row in results:
        row["speedup"] = base / row["step_s"] if base else float("nan")
    packed = args.prompts * args.prompt + args.prompts * args.responses * args.response
    summary = {
        "benchmark": "sequence_parallel_cpu",
        "model": {"family": "qwen3", "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "kv_heads": args.kv_heads, "vocab": args.vocab, "dtype": "float32", "attention_backend": "sdpa"},
        "batch": {"prompts": args.prompts, "responses_per_prompt": args.responses, "prompt_tokens": args.prompt,
                  "response_tokens": args.response, "packed_tokens": packed},
        "threads_total": args.threads, "warmup": args.warmup, "iters": args.iters, "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()), "results": results,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary, indent=1))
    print(table(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
