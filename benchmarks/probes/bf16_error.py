"""Probe: how far each bf16 log-prob path is from float32, per backend (the target: no worse than the naive path).

Qwen3-1.7B shape, random weights; the reference is the naive per-sequence batch in float32 (SDPA). The same
weights in bf16 then run the naive path and ZoRRo on each backend (flex, cudnn, flash_varlen). Per path: the
mean and largest |log-prob error| over the response tokens, and the relative L2 error of the gradient of the
log-prob sum over all parameters. The target: every ZoRRo backend's error no larger than the naive path's.

    python benchmarks/probes/bf16_error.py --out bf16_error.json
    python benchmarks/probes/bf16_error.py --seeds 8 --out bf16_error.json   # means over 8 batches
    python benchmarks/probes/bf16_error.py --model tiny --case 2,4,64,32      # smoke (needs CUDA too)
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.zorro_train import build_model, make_batch  # noqa: E402

from arctic_rl.modules.models import response_logprobs  # noqa: E402
from arctic_rl.zorro import zorro_response_logprobs  # noqa: E402


def logprobs_and_grad(fn, model, batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    lp, _ = fn(model, *batch, 1.0, False, 0, **kw)
    lp.sum().backward()
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return lp.detach().float(), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b")
    parser.add_argument("--case", default="2,8,1024,256", help="prompts,G,P,R")
    parser.add_argument("--backends", default="flex,cudnn,flash_varlen")
    parser.add_argument("--seeds", type=int, default=1, help="batch seeds 1..N; errors are averaged over them")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    n, g, p, r = (int(x) for x in args.case.split(","))
    bf16 = build_model(args.model)
    reference = copy.deepcopy(bf16).float()  # the same weights (bf16 values) in float32
    paths = [("naive", response_logprobs, {})] + [(b, zorro_response_logprobs, {"attention_backend": b}) for b in args.backends.split(",")]
    keys = ("mean_abs_logprob_error", "max_abs_logprob_error", "grad_rel_l2_error")
    result = {"command": " ".join(sys.argv), "case": [n, g, p, r], "gpu": torch.cuda.get_device_name(),
              "seeds": list(range(1, args.seeds + 1)), "per_seed": [], "paths": {}}
    for seed in result["seeds"]:  # batch seeds: the largest error is one token's, so it varies with the data
        batch = make_batch(n, g, p, r, bf16.config.vocab_size, seed=seed)
        reference.cuda()
        ref_lp, ref_grad = logprobs_and_grad(response_logprobs, reference, batch)
        reference.cpu()
        torch.cuda.empty_cache()
        mask = batch[2].bool()
        row = {}
        for name, fn, kw in paths:
            lp, grad = logprobs_and_grad(fn, bf16, batch, **kw)
            err = (lp - ref_lp).abs()[mask]
            row[name] = dict(zip(keys, (err.mean().item(), err.max().item(), ((grad - ref_grad).norm() / ref_grad.norm()).item())))
        result["per_seed"].append(row)
        print(json.dumps({"seed": seed, **row}), flush=True)
    for name, _, _ in paths:  # over the seeds: the mean of each error, and how often the path's max is within naive's
        result["paths"][name] = {k: sum(row[name][k] for row in result["per_seed"]) / args.seeds for k in keys}
        result["paths"][name]["seeds_max_within_naive"] = sum(
            row[name]["max_abs_logprob_error"] <= row["naive"]["max_abs_logprob_error"] for row in result["per_seed"])
    naive = result["paths"]["naive"]
    result["within_naive"] = {name: all(v[k] <= naive[k] for k in ("mean_abs_logprob_error", "max_abs_logprob_error"))
                              for name, v in result["paths"].items() if name != "naive"}
    print(json.dumps({"over_seeds": result["paths"], "within_naive": result["within_naive"]}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
