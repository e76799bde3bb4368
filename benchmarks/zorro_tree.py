"""Prefix-tree ZoRRo benchmark: fwd+bwd of tree rollouts' response log-probs, each shared prefix once
(``zorro_dedup: tree``) vs. each group's prompt once (``group``) vs. the naive batch.

Tree rollouts (multi-turn, branching): ``prompts`` prompts of ``P`` tokens; from each, ``b1`` first turns of
``T`` tokens; from each first turn, ``b2`` second turns of ``T`` tokens. A sequence is prompt + turn 1 +
turn 2, so ``N = prompts x b1 x b2`` sequences whose responses (``2T`` tokens) share their first turn with
``b2 - 1`` others. Every response token is a target (the log-probs of a first turn are the same in each of
its branches, and each branch's copy is trained, as the trainer does).

Sides, timed in one process on copies of the same weights (Qwen3-1.7B shape, random weights, bf16, gradient
checkpointing, Liger optional):
- ``naive``: ``response_logprobs``, the per-sequence batch ``[N, P + 2T]`` through SDPA;
- ``group``: ``zorro_response_logprobs(dedup="group")`` on flex: each prompt once, each response whole;
- ``group_cudnn``: the same on the ``cudnn`` cascade backend (the fastest group backend; it has no trees);
- ``tree``: ``zorro_response_logprobs(dedup="tree")`` on flex: every shared prefix once.

FLOPs are counted from each side's own packed work (``zorro_train.model_flops``): tokens run through the
model, query-key pairs each token may attend (its position + 1: in a prefix trie a token sees exactly its own
prefix) and logit rows; MFU against 790 TFLOP/s. A float32 check on a tiny model compares the tree's
log-probs and gradients with the naive path's.

    python benchmarks/zorro_tree.py --out tree.json                                   # the issue's shape, ~2 min
    python benchmarks/zorro_tree.py --model tiny --shape 2,2,2,64,16 --device cpu     # smoke (sdpa on CPU)
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.zorro_train import PEAK_TFLOPS, SHAPES, measure, model_flops, visible_keys  # noqa: E402

from arctic_rl.liger import apply_liger  # noqa: E402
from arctic_rl.modules.models import response_logprobs  # noqa: E402
from arctic_rl.zorro import zorro_response_logprobs  # noqa: E402
from arctic_rl.zorro.packing import pack_shared_prompts  # noqa: E402
from arctic_rl.zorro.prefix_tree import pack_prefix_tree  # noqa: E402


def tree_batch(prompts: int, b1: int, b2: int, p: int, t: int, vocab: int, device: str, seed: int = 1):
    """``(prompt_token_ids, response_ids, response_mask)`` of the tree described in the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids, responses = [], []
    for _ in range(prompts):
        prompt = torch.randint(1, vocab, (p,), generator=gen).tolist()
        for _ in range(b1):
            first = torch.randint(1, vocab, (t,), generator=gen)
            for _ in range(b2):
                prompt_ids.append(prompt)
                responses.append(torch.cat([first, torch.randint(1, vocab, (t,), generator=gen)]))
    ids = torch.stack(responses).to(device)
    return prompt_ids, ids, torch.ones_like(ids, dtype=torch.float32)


def work(batch, shape: dict) -> dict:
    """Tokens, attention pairs, logit rows and FLOPs of each side's own packed layout."""
    prompts, ids, mask = batch
    n, r = ids.shape
    lengths = [r] * n
    group = pack_shared_prompts(prompts, ids.cpu(), lengths, pad_to_multiple=1, pad_token_id=0)
    tree = pack_prefix_tree(prompts, ids.cpu(), lengths, 1, 0, target_mask=mask.cpu())
    out = {}
    for side, tokens, pairs, rows in (
        ("naive", n * (len(prompts[0]) + r), n * visible_keys(0, len(prompts[0]) + r), n * r),
        ("group", group.input_ids.numel(), int((group.position_ids + 1).sum()), group.target_ids.numel()),
        ("tree", tree.input_ids.numel(), int((tree.position_ids + 1).sum()), tree.target_ids.numel()),
    ):
        out[side] = dict(tokens=tokens, attention_pairs=pairs, logit_rows=rows, flops=model_flops(shape, tokens, pairs, rows))
    return out


def check_fp32(device: str) -> dict:
    """Tiny model, float32: the tree's log-probs and parameter gradients against the naive path's."""
    from benchmarks.zorro_train import build_model

    model = build_model("tiny").float().to(device) if device == "cuda" else build_model_cpu("tiny")
    twin = copy.deepcopy(model)
    batch = tree_batch(2, 3, 2, 150, 40, 1000, device)
    out = {}
    for m, kw in ((model, None), (twin, {"dedup": "tree", "attention_backend": "flex" if device == "cuda" else "sdpa"})):
        m.zero_grad(set_to_none=True)
        fn = response_logprobs if kw is None else zorro_response_logprobs
        lp, _ = fn(m, *batch, 1.0, False, 0, **(kw or {}))
        lp.sum().backward()
        out["naive" if kw is None else "tree"] = lp.detach()
    grad = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), twin.parameters()))
    return {"fp32_tiny_max_abs_logprob_diff": (out["naive"] - out["tree"]).abs().max().item(), "fp32_tiny_max_abs_grad_diff": grad}


def build_model_cpu(shape: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=65536, rope_theta=1e6)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.config.use_cache = False
    return model.train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--shape", default="4,4,4,2048,256", help="prompts,b1,b2,P,T")
    parser.add_argument("--sides", default="naive,group,group_cudnn,tree")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--liger", action="store_true", help="Liger's kernels on every side")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    prompts, b1, b2, p, t = (int(x) for x in args.shape.split(","))
    shape = SHAPES[args.model]
    batch = tree_batch(prompts, b1, b2, p, t, shape["vocab_size"], args.device)
    result = {"command": " ".join(sys.argv), "model": args.model, "shape": dict(prompts=prompts, b1=b1, b2=b2, P=p, T=t),
              "liger": args.liger, "work": work(batch, shape), **check_fp32(args.device)}
    if args.device == "cuda":
        from benchmarks.zorro_train import build_model

        model = build_model(args.model)
        result["gpu"] = torch.cuda.get_device_name()
    else:
        model = build_model_cpu(args.model)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.liger:
        apply_liger(model)
    flex = "flex" if args.device == "cuda" else "sdpa"
    sides = {"naive": (response_logprobs, {}, "naive"),
             "group": (zorro_response_logprobs, {"attention_backend": flex}, "group"),
             "group_cudnn": (zorro_response_logprobs, {"attention_backend": "cudnn"}, "group"),
             "tree": (zorro_response_logprobs, {"attention_backend": flex, "dedup": "tree"}, "tree")}
    timing = measure if args.device == "cuda" else None
    for side in args.sides.split(","):
        fn, kw, layout = sides[side]
        if timing is None:  # CPU smoke: one step, no timing
            model.zero_grad(set_to_none=True)
            fn(model, *batch, 1.0, False, 0, **kw)[0].sum().backward()
            result[side] = {"ran": True}
            continue
        try:
            seconds, peak, times = timing(fn, model, batch, 2, args.iters, **kw)
            flops = result["work"][layout]["flops"]
            result[side] = {"s": round(seconds, 4), "peak_gib": round(peak, 1), "times": [round(x, 4) for x in times],
                            "mfu": round(flops / seconds / 1e12 / PEAK_TFLOPS, 3)}
        except torch.cuda.OutOfMemoryError as err:
            result[side] = {"error": f"OOM: {str(err)[:160]}"}
            model.zero_grad(set_to_none=True)
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps({side: result[side]}), flush=True)
    w = result["work"]
    for a, b in (("naive", "tree"), ("group", "tree"), ("naive", "group"), ("naive", "group_cudnn"), ("group_cudnn", "tree")):
        if "s" in result.get(a, {}) and "s" in result.get(b, {}):
            flop_ratio = w[sides[a][2]]["flops"] / w[sides[b][2]]["flops"]
            speedup = result[a]["s"] / result[b]["s"]
            result[f"{b}_over_{a}"] = {"speedup": round(speedup, 2), "flop_ratio": round(flop_ratio, 2),
                                       "speedup_over_flop_ratio": round(speedup / flop_ratio, 3)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("naive", "group", "group_cudnn", "tree")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
