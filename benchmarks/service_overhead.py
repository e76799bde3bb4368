"""What the service's transports cost: per-operation time of ``forward_backward`` and ``sample`` over
``http`` and ``ray`` against ``local`` (in-process), the same model and batch in the same run, plus a
loopback load run (concurrent clients calling ``status``: requests/s, p50/p99 latency).

    python benchmarks/service_overhead.py --shape quickstart --protocols local,http,ray --out benchmarks/results/service_cpu_<date>.json
    python benchmarks/service_overhead.py --shape qwen3-1.7b --protocols local,http --engine transformers   # GPU
    python benchmarks/service_overhead.py --protocols local --launchers processes,ray --devices 2 --engine transformers

``--launchers``: how the training ranks start (``training.launcher``): ``processes`` (local rank processes, the
baseline) or ``ray`` (one Ray actor per rank, on a local Ray cluster this run starts); each protocol runs with each.

Reported per protocol and operation: the median over ``--repeats`` calls, the request and reply bytes,
and (for the network protocols) the overhead over ``local`` in seconds and as a share of the local time,
and the tensor bytes moved per second of that overhead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # model config, prompts x G, prompt length, response length
    "quickstart": (None, 16, 8, 8, 8),
    "qwen3-1.7b": ({"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                    "max_position_embeddings": 4096, "tie_word_embeddings": True}, 2, 8, 1024, 1024),
}


def build_config(args, root: Path, launcher: str = "processes") -> dict:
    from arctic_rl.tasks.toy import tiny_qwen3_config, write_task

    toy = write_task(root / "toy", num_train=8, num_val=1)
    model, _, _, prompt_len, response_len = SHAPES[args.shape]
    tokenizer = toy / "tokenizer"
    if model is None:
        from transformers import AutoTokenizer

        model = tiny_qwen3_config(len(AutoTokenizer.from_pretrained(tokenizer)))
    else:
        from benchmarks.recipe_gsm8k_gpu import word_tokenizer

        tokenizer = word_tokenizer(model["vocab_size"], root / "tokenizer")
    gpu = torch.cuda.is_available()
    return {
        "model": model, "tokenizer": str(tokenizer), "dtype": "bfloat16" if gpu else "float32",
        "training": {"accelerator": "gpu" if gpu else "cpu", "precision": "bf16-true" if gpu else "32-true",
                     "devices": args.devices, "launcher": launcher, **({"zero_stage": 2} if args.devices > 1 else {})},
        "optim": {"learning_rate": 1e-6},
        "compute": {"gradient_checkpointing": gpu, "self_check": False},
        "engines": {"engine": args.engine}, "sampling": {"max_prompt_length": prompt_len, "max_response_length": response_len},
        "server": {"root_dir": str(root / "server")},
    }


def make_batch(args, vocab: int):
    from arctic_rl.serve.batch import TrainBatch

    _, prompts, g, prompt_len, response_len = SHAPES[args.shape]
    gen = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(prompts)]
    responses = [torch.randint(0, vocab, (response_len,), generator=gen).tolist() for _ in range(prompts * g)]
    advantages = torch.randn(prompts * g, generator=gen)
    batch = TrainBatch.build([p for p in prompt_ids for _ in range(g)], responses, advantages,
                             old_logprobs=torch.full((prompts * g, response_len), -5.0))
    return prompt_ids, batch


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def message_bytes(message) -> int:
    from arctic_rl.serve import wire

    return len(wire.encode(wire.Frame("forward_backward", message)))


def load_run(client, clients: int, calls: int) -> dict:
    """``clients`` threads each calling ``status`` ``calls`` times over one transport each."""
    from arctic_rl.serve.client import ArcticRLClient

    latencies, lock = [], threading.Lock()
    server = client._server  # the embedded server the client started
    extra = [ArcticRLClient(client.config, server_url=server.url, auth_token=server.token) for _ in range(clients)]

    def worker(c):
        for _ in range(calls):
            start = time.perf_counter()
            c.status()
            with lock:
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(c,)) for c in extra]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    for c in extra:
        c.close()
    latencies.sort()
    return {"clients": clients, "requests": len(latencies), "requests_per_s": len(latencies) / wall,
            "p50_ms": 1e3 * latencies[len(latencies) // 2], "p99_ms": 1e3 * latencies[int(0.99 * (len(latencies) - 1))]}


def run_protocol(args, protocol: str, root: Path, launcher: str = "processes") -> dict:
    from arctic_rl.serve.client import ArcticRLClient

    config = build_config(args, root / f"{protocol}-{launcher}", launcher)
    with ArcticRLClient(config, protocol=protocol) as client:
        vocab = client.status()["vocab_size"]
        prompts, batch = make_batch(args, vocab)
        _, _, g, _, response_len = SHAPES[args.shape]
        ops = {
            "forward_backward": lambda: client.forward_backward(batch, "dapo"),
            "sample": lambda: client.sample(prompts, n=g, max_tokens=args.sample_tokens or response_len, seed=0),
        }
        result = {"request_bytes": {"forward_backward": message_bytes(batch.to_message({"loss": "dapo"}))}}
        for name, fn in ops.items():
            fn()  # warm-up (first-call compilation, caches)
            times = timed(fn, args.repeats)
            result[name] = {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}
        client.zero_grad()
        if protocol == "http":
            result["load"] = load_run(client, args.load_clients, args.load_calls)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="quickstart")
    parser.add_argument("--protocols", default="local,http,ray")
    parser.add_argument("--engine", default="vllm")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sample-tokens", type=int, help="tokens per sample call (default: the shape's response length)")
    parser.add_argument("--launchers", default="processes", help="training.launcher values to compare: processes,ray")
    parser.add_argument("--devices", type=int, default=1, help="training.devices (ranks)")
    parser.add_argument("--load-clients", type=int, default=4)
    parser.add_argument("--load-calls", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for protocol, launcher in [(p, la) for la in args.launchers.split(",") for p in args.protocols.split(",")]:
            protocol = protocol if launcher == "processes" else f"{protocol}/ranks-{launcher}"
            results[protocol] = run_protocol(args, protocol.split("/")[0], Path(tmp), launcher)
            print(protocol, {k: v.get("median_s", v) for k, v in results[protocol].items() if isinstance(v, dict)}, flush=True)
    local = results.get("local")
    for protocol, result in results.items():
        if local is None or protocol == "local":
            continue
        for op in ("forward_backward", "sample"):
            extra = result[op]["median_s"] - local[op]["median_s"]
            result[op]["overhead_s"] = extra
            result[op]["overhead_share"] = extra / local[op]["median_s"]
        moved = result["request_bytes"]["forward_backward"]
        result["forward_backward"]["bytes_per_overhead_s"] = moved / max(result["forward_backward"]["overhead_s"], 1e-9)
    record = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "shape": args.shape,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu x{torch.get_num_threads()}",
              "command": " ".join(sys.argv), "results": results}
    print(json.dumps({p: {op: {k: v for k, v in r[op].items() if k != "times_s"} for op in ("forward_backward", "sample")}
                      for p, r in results.items()}, indent=1))
    for p, r in results.items():
        if "load" in r:
            print(p, "load", r["load"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
