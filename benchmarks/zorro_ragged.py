"""Ragged rollouts: ZoRRo's fwd+bwd tokens/s when response lengths vary, against a regular layout of the same
token count (the target: at least 0.9x).

Per case ``[prompts, G, P, R]`` and backend: the *ragged* side draws every response's length uniformly from
``[R/2, R]`` with a new seed at every step (a GRPO batch is new each step: no layout repeats, as in training);
the *regular* side gives every response the mean length of those draws, so both run the same number of
deduplicated tokens. Each side: 2 warm-up steps, then ``--iters`` steps, median tokens/s (prompt tokens once
per group plus each response's own tokens, per second). Qwen3-1.7B shape, random weights, bf16, gradient
checkpointing, Liger's kernels (``--no-liger`` to leave them out).

    python benchmarks/zorro_ragged.py --out ragged.json                         # ~2 min on an H200
    python benchmarks/zorro_ragged.py --model tiny --cases '[[2,4,64,32]]'      # smoke (CUDA)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.zorro_train import SHAPES, build_model, train_step  # noqa: E402

from arctic_rl.liger import apply_liger  # noqa: E402
from arctic_rl.zorro import zorro_response_logprobs  # noqa: E402


def batch(n: int, g: int, p: int, r: int, lengths: list[int], vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for _ in range(n)]
    ids = torch.randint(1, vocab, (n * g, r), generator=gen).cuda()
    mask = (torch.arange(r)[None] < torch.tensor(lengths)[:, None]).float().cuda()
    return [prompts[i // g] for i in range(n * g)], ids, mask


def ragged_lengths(rows: int, r: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(r // 2, r + 1, (rows,), generator=gen).tolist()


def tokens_per_s(model, case, backend: str, ragged: bool, iters: int, vocab: int) -> dict:
    n, g, p, r = case
    rates, tokens = [], []
    mean_len = round(statistics.mean(ragged_lengths(n * g, r, 0)))
    for step in range(2 + iters):
        lengths = ragged_lengths(n * g, r, step) if ragged else [mean_len] * (n * g)
        b = batch(n, g, p, r, lengths, vocab, seed=step)
        count = n * p + sum(lengths)
        torch.cuda.synchronize()
        started = time.perf_counter()
        train_step(zorro_response_logprobs, model, b, attention_backend=backend)
        torch.cuda.synchronize()
        if step >= 2:
            rates.append(count / (time.perf_counter() - started))
            tokens.append(count)
    model.zero_grad(set_to_none=True)
    return {"tokens_per_s": round(statistics.median(rates)), "all": [round(x) for x in rates], "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--cases", default="[[2, 8, 4096, 512], [1, 16, 8192, 1024]]")
    parser.add_argument("--backends", default="flex,cudnn")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = build_model(args.model)
    if not args.no_liger:
        apply_liger(model)
    vocab = SHAPES[args.model]["vocab_size"]
    result = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "liger": not args.no_liger, "rows": []}
    for case in json.loads(args.cases):
        for backend in args.backends.split(","):
            row = {"case": case, "backend": backend}
            for side in ("regular", "ragged"):
                try:
                    row[side] = tokens_per_s(model, case, backend, side == "ragged", args.iters, vocab)
                except torch.cuda.OutOfMemoryError as err:
                    row[side] = {"error": f"OOM: {str(err)[:160]}"}
                torch.cuda.empty_cache()
            if "tokens_per_s" in row["regular"] and "tokens_per_s" in row["ragged"]:
                row["ragged_over_regular"] = round(row["ragged"]["tokens_per_s"] / row["regular"]["tokens_per_s"], 3)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
