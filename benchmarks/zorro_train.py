"""ZoRRo Train benchmark: fwd+bwd of response log-probs, deduplicated (FlexAttention) vs. naive.

Qwen3-1.7B shape, random weights, bf16, gradient checkpointing (non-reentrant) on both sides.
baseline: ``arctic_rl.modules.models.response_logprobs`` — the dense per-sequence batch ``[N, P+R]``
          through SDPA (flash backend; no padding, so transformers passes no mask).
zorro:    ``arctic_rl.zorro.zorro_response_logprobs`` — one packed row per call, FlexAttention with
          the ZoRRo block mask; packing and mask building are inside the timed step.
cudnn:    the same with ``attention_backend="cudnn"``: cascade attention on cuDNN's fused kernels in
          dense batches (prompts-first row, no compilation).
varlen:   the same with ``attention_backend="flash_varlen"``: cascade attention on torch's
          FlashAttention-2 varlen kernels.
Both timed in the same process on the same weights. MFU counts model FLOPs of each side's own
work (matmuls: 3x forward; attention: 3.5x forward over the *allowed* query-key pairs only; no
recompute) against 790 TFLOP/s (bf16 dense matmul measured on this H200 kind).

    python benchmarks/zorro_train.py --out results.json            # the four cases, ~5 min on an H200
    python benchmarks/zorro_train.py --model tiny --cases '[[2,4,64,32]]'   # smoke test
    python benchmarks/zorro_train.py --sliding-window 1024 --cases '[[2,8,4096,512]]'   # Gemma-style layers
    python benchmarks/zorro_train.py --liger both --sides base,cudnn --out liger.json   # with and without Liger

``--liger on|both``: Liger's fused RMSNorm, SwiGLU and RoPE kernels (``arctic_rl.liger``, what
``model.liger`` does) on both sides, baseline and ZoRRo, in copies of the same weights; ``both`` measures
every case without and then with them (one table row each, each against its own baseline).

``--compile-layers``: a regional ``torch.compile`` of every decoder layer on both sides (``layer.compile()``;
ZoRRo's attention stays outside the graph), fusing the residual adds, norms and casts around attention.
``--checkpointing both|base|none|selective``: which sides keep activation checkpointing (default both). ``selective``:
both sides keep it, selective (``model.compute.gradient_checkpointing: selective``: matmul and attention outputs kept,
only the elementwise work replayed). ``base``: ZoRRo's side
runs without it (no recompute in backward), which its smaller activations afford; ``none``: neither (the baseline's
activations, 4.5-6x as many tokens, run out of memory at the default cases, recorded as the row's ``base_error``).

``--base-micro-batch N``: the baseline in micro-batches of N sequences (each backward before the next forward):
the same gradients in less memory, for settings (``--checkpointing selective``) whose whole naive batch does not fit.

``--sliding-window W``: Gemma-style alternating layers (``layer_types`` sliding, full, sliding, ...;
window ``W``) on the same shape; the baseline gets transformers' own sliding-window masks, ZoRRo
applies the window per layer (cascade backends run the windowed layers on flex). Attention pairs
(and so FLOPs / MFU) count each layer's allowed pairs: ``min(x + 1, W)`` keys for a token at
position ``x`` of its sequence on windowed layers.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import time

import torch

from arctic_rl.liger import apply_liger
from arctic_rl.checkpointing import enable_checkpointing
from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import pack_shared_prompts, zorro_block_mask, zorro_response_logprobs
from arctic_rl.zorro.attention import FLEX_COMPILE_ENV

SHAPES = {
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000),
}
CASES = [[2, 8, 4096, 512], [2, 8, 1024, 1024], [1, 16, 8192, 1024], [1, 16, 16384, 2048]]
PEAK_TFLOPS = 790.0


def layer_types(shape: dict, window: int) -> list[str] | None:
    """Alternating sliding / full layers (Gemma2's pattern), or None (all full) without a window."""
    if not window:
        return None
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(shape["num_hidden_layers"])]


def build_model(shape: str, window: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    windowed = dict(use_sliding_window=True, sliding_window=window, layer_types=layer_types(SHAPES[shape], window)) if window else {}
    config = Qwen3Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=65536, rope_theta=1e6, **windowed)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def compile_layers(model: torch.nn.Module) -> None:
    """Regional compile: each decoder layer compiled in place (one graph for all, parameters as inputs). ZoRRo's
    attention function runs eagerly inside it (a graph break: its packed layout is host-side data that would
    guard and recompile; flex compiles on its own), swapped in here for the experiment only."""
    import torch._dynamo

    from arctic_rl.zorro import attention

    if not getattr(attention.zorro_attention, "_torchdynamo_disable", False):
        attention.zorro_attention = torch.compiler.disable(attention.zorro_attention)  # register_zorro_attention reads it
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in model.model.layers:
        layer.compile()


def make_batch(n: int, g: int, p: int, r: int, vocab: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for _ in range(n)]
    response_ids = torch.randint(1, vocab, (n * g, r), generator=gen).cuda()
    return [prompts[i // g] for i in range(n * g)], response_ids, torch.ones(n * g, r, device="cuda")


def model_flops(shape: dict, tokens: int, attention_pairs: int, logit_rows: int) -> float:
    """Training FLOPs (fwd + bwd, no recompute) of the decoder on ``tokens`` tokens with
    ``attention_pairs`` allowed query-key pairs per layer, plus the output head on ``logit_rows``."""
    h, q, kv = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    layer_params = h * q + 2 * h * kv + q * h + 3 * h * shape["intermediate_size"]
    layers = shape["num_hidden_layers"]
    matmul = 3 * 2 * layer_params * layers * tokens + 3 * 2 * h * shape["vocab_size"] * logit_rows
    attention = 3.5 * 4 * q * attention_pairs * layers
    return matmul + attention


def visible_keys(first: int, last: int, window: int = 0) -> int:
    """Sum over positions ``x`` in ``[first, last)`` of the keys a causal token there sees."""
    full = (last * (last + 1) - first * (first + 1)) // 2
    if not window or last <= window:
        return full
    inside = max(first, window)  # from position W on a token sees exactly W keys
    return visible_keys(first, inside) + window * (last - inside)


def work(case: list[int], shape: dict, window: int = 0) -> dict:
    n, g, p, r = case
    s = p + r
    kinds = layer_types(shape, window) or ["full_attention"] * shape["num_hidden_layers"]
    share = kinds.count("sliding_attention") / len(kinds)  # pairs below are averages over layers

    def pairs(first: int, last: int) -> float:
        return (1 - share) * visible_keys(first, last) + share * visible_keys(first, last, window)

    naive_pairs = n * g * pairs(0, s)
    dedup_pairs = n * (pairs(0, p) + g * pairs(p, s))
    rows = n * g * r
    return dict(
        tokens_naive=n * g * s, tokens_dedup=n * (p + g * r),
        flops_naive=model_flops(shape, n * g * s, naive_pairs, rows),
        flops_dedup=model_flops(shape, n * (p + g * r), dedup_pairs, rows),
        attention_share_dedup=3.5 * 4 * shape["num_attention_heads"] * shape["head_dim"] * dedup_pairs
        * shape["num_hidden_layers"] / model_flops(shape, n * (p + g * r), dedup_pairs, rows),
    )


def train_step(fn, model, batch, micro_batch: int | None = None, **kw) -> None:
    """One forward+backward of the batch's log-prob sum; ``micro_batch``: in chunks of that many sequences, each
    backward before the next forward (the same gradients, the activations of one chunk at a time)."""
    model.zero_grad(set_to_none=True)
    prompts, ids, mask = batch
    size = micro_batch or len(prompts)
    for i in range(0, len(prompts), size):
        logprobs, _ = fn(model, prompts[i:i + size], ids[i:i + size], mask[i:i + size], 1.0, False, 0, **kw)
        logprobs.sum().backward()


def measure(fn, model, batch, warmup: int, iters: int, **kw) -> tuple[float, float, list[float]]:
    """(median seconds, peak GiB, all times) of ``iters`` steps after ``warmup`` steps."""
    for _ in range(warmup):
        train_step(fn, model, batch, **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        train_step(fn, model, batch, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30, times


def kernel_breakdown(fn, model, batch, **kw) -> dict[str, float]:
    """Milliseconds of GPU kernel time in one step: attention, matmul, other (from torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(fn, model, batch, **kw)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    out = {"attention_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0}
    kernels = sorted(((evt.self_device_time_total / 1e3, evt.key) for evt in prof.key_averages()), reverse=True)
    for ms, key in kernels:
        name = key.lower()
        if any(k in name for k in ("flash", "flex", "fmha", "attention", "triton_tem", "sdpa")):
            out["attention_ms"] += ms
        elif any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")):
            out["matmul_ms"] += ms
        else:
            out["other_ms"] += ms
    out = {k: round(v, 1) for k, v in out.items()}
    out["top"] = [[round(ms, 1), key[:90]] for ms, key in kernels[:14]]
    return out


def packing_overhead_ms(batch) -> dict[str, float]:
    """Host-side preparation of one ZoRRo call, median of 5, ms: packing plus the flex block mask,
    and packing (prompts first) plus the cascade plan."""
    from arctic_rl.zorro.cascade import cascade_plan

    prompts, ids, mask = batch
    out = {}
    for name, prompts_first, pad in (("flex", False, 128), ("cascade", True, 1)):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            layout = pack_shared_prompts(prompts, ids, [int(x) for x in mask.sum(-1).tolist()], pad, prompts_first=prompts_first)
            if prompts_first:
                cascade_plan(layout.segment_ids, layout.parent_ids)
            else:
                zorro_block_mask(layout.segment_ids, layout.parent_ids, 128)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        out[name] = round(statistics.median(times), 1)
    return out


def run_case(case, shape_name, base_model, zorro_model, args) -> dict:
    shape = SHAPES[shape_name]
    batch = make_batch(*case, shape["vocab_size"])
    row = dict(case=case, sliding_window=args.sliding_window, **work(case, shape, args.sliding_window))
    base_kw = {"micro_batch": args.base_micro_batch} if args.base_micro_batch else {}
    sides = (("base", response_logprobs, base_model, base_kw, 1),
             ("zorro", zorro_response_logprobs, zorro_model, {"attention_backend": "flex"}, 2),
             ("cudnn", zorro_response_logprobs, zorro_model, {"attention_backend": "cudnn"}, 2),
             ("varlen", zorro_response_logprobs, zorro_model, {"attention_backend": "flash_varlen"}, 1))
    for side, fn, model, kw, warm in (s for s in sides if s[0] in args.sides):
        try:
            t, mem, times = measure(fn, model, batch, warm, args.iters, **kw)
            row.update({f"{side}_s": round(t, 4), f"{side}_mem_gib": round(mem, 1), f"{side}_times": [round(x, 4) for x in times]})
            flops = row["flops_naive" if side == "base" else "flops_dedup"]
            row[f"{side}_mfu"] = round(flops / t / 1e12 / PEAK_TFLOPS, 3)
            if args.profile:
                row[f"{side}_kernels"] = kernel_breakdown(fn, model, batch, **kw)
        except torch.cuda.OutOfMemoryError as err:
            row[f"{side}_error"] = f"OOM: {str(err)[:160]}"
            model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
    row["pack_and_mask_ms"] = packing_overhead_ms(batch)
    row["token_ratio"] = round(row["tokens_naive"] / row["tokens_dedup"], 2)
    row["flop_ratio"] = round(row["flops_naive"] / row["flops_dedup"], 2)
    if "base_s" in row and "zorro_s" in row:  # both sides measured in this process
        row["speedup"] = round(row["base_s"] / row["zorro_s"], 2)
        row["speedup_over_token_ratio"] = round(row["speedup"] / row["token_ratio"], 3)
        row["speedup_over_flop_ratio"] = round(row["speedup"] / row["flop_ratio"], 3)
    for side in ("cudnn", "varlen"):
        if "base_s" in row and f"{side}_s" in row:
            row[f"speedup_{side}"] = round(row["base_s"] / row[f"{side}_s"], 2)
            row[f"speedup_{side}_over_token_ratio"] = round(row[f"speedup_{side}"] / row["token_ratio"], 3)
            row[f"speedup_{side}_over_flop_ratio"] = round(row[f"speedup_{side}"] / row["flop_ratio"], 3)
    return row


def check_correctness(window: int = 0, liger: bool = False, compiled: bool = False) -> dict:
    """fp32 tiny model (windowed as the run, window scaled to the short batch): ZoRRo flex vs.
    naive SDPA, max |d logprob| and max |d grad| (``liger``: ZoRRo's side with Liger's kernels)."""
    model = build_model("tiny", min(window, 150)).float()
    twin = copy.deepcopy(model)
    if liger:
        apply_liger(twin)
    if compiled:
        compile_layers(twin)
    batch = make_batch(2, 4, 200, 100, 1000)
    train_step(response_logprobs, model, batch)
    train_step(zorro_response_logprobs, twin, batch, attention_backend="flex")
    grad = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), twin.parameters()))
    with torch.no_grad():
        a = response_logprobs(model, *batch, 1.0, False, 0)[0]
        b = zorro_response_logprobs(twin, *batch, 1.0, False, 0, attention_backend="flex")[0]
    prefix = "fp32_tiny_" + ("liger_" if liger else "") + ("compiled_" if compiled else "")
    return {f"{prefix}max_abs_logprob_diff": (a - b).abs().max().item(), f"{prefix}max_abs_grad_diff": grad}


SIDE_BACKEND = {"zorro": "flex", "cudnn": "cudnn", "varlen": "flash_varlen"}


def markdown(rows: list[dict]) -> str:
    """The BENCHMARKS.md table: one line per case and measured ZoRRo backend, against the baseline."""
    head = ("| prompts x G, P/R | tokens naive / dedup (ratio) | FLOP ratio | Liger | baseline s | backend | ZoRRo s | speedup | "
            "speedup / token ratio | speedup / FLOP ratio | peak GiB base / ZoRRo | MFU base / ZoRRo |")
    lines = [head, "|" + "---|" * 12]
    for x in rows:
        n, g, p, r = x["case"]
        window = f", window {x['sliding_window']} (alternating)" if x.get("sliding_window") else ""
        case = f"{n}x{g}, {p}/{r}{window} | {x['tokens_naive']:,} / {x['tokens_dedup']:,} ({x['token_ratio']}x) | {x['flop_ratio']}x"
        case += " | on" if x.get("liger") else " | off"
        base = f"{x['base_s']:.3f}" if "base_s" in x else x.get("base_error", "-")[:20]
        for side, backend in SIDE_BACKEND.items():
            if f"{side}_s" not in x and f"{side}_error" not in x:
                continue
            if f"{side}_s" not in x:
                lines.append(f"| {case} | {base} | {backend} | {x[f'{side}_error'][:20]} | | | | | |")
                continue
            t = x[f"{side}_s"]
            speed = x["base_s"] / t if "base_s" in x else None
            ratios = f"{speed:.2f}x | {speed / x['token_ratio']:.2f} | {speed / x['flop_ratio']:.2f}" if speed else "- | - | -"
            mem = f"{x.get('base_mem_gib', '-')} / {x[f'{side}_mem_gib']}"
            mfu = f"{x['base_mfu']:.0%} / {x[f'{side}_mfu']:.0%}" if "base_mfu" in x else f"- / {x[f'{side}_mfu']:.0%}"
            lines.append(f"| {case} | {base} | {backend} | {t:.3f} | {ratios} | {mem} | {mfu} |")
            case = " | | |"
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="1.7b", choices=sorted(SHAPES))
    parser.add_argument("--cases", default=json.dumps(CASES), help="JSON list of [prompts, G, P, R]")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="add a per-step kernel-time breakdown")
    parser.add_argument("--out", default=None, help="write all results as JSON here")
    parser.add_argument("--sides", default="base,zorro,cudnn,varlen",
                        help="which of base (naive SDPA), zorro (flex), cudnn (cudnn cascade), varlen (flash_varlen cascade) to run")
    parser.add_argument("--skip-check", action="store_true", help="skip the fp32 correctness check")
    parser.add_argument("--liger", default="off", choices=["off", "on", "both"],
                        help="Liger's kernels on both sides: off, on, or both (each case without, then with)")
    parser.add_argument("--compile-layers", action="store_true", help="regional torch.compile of every decoder layer, both sides")
    parser.add_argument("--checkpointing", default="both", choices=["both", "base", "none", "selective"],
                        help="which sides keep activation checkpointing: both, base only (ZoRRo without), none, or both selective")
    parser.add_argument("--base-micro-batch", type=int, default=0,
                        help="the baseline in micro-batches of this many sequences (0: the whole batch at once)")
    parser.add_argument("--sliding-window", type=int, default=0,
                        help="window of Gemma-style alternating sliding / full layers (0: every layer full)")
    args = parser.parse_args()
    import transformers

    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
              "flex_compile": os.environ.get(FLEX_COMPILE_ENV, "auto"),
              "liger": args.liger, "compile_layers": args.compile_layers, "checkpointing": args.checkpointing,
              "base_micro_batch": args.base_micro_batch,
              "correctness": None, "rows": []}
    if not args.skip_check:
        result["correctness"] = check_correctness(args.sliding_window, compiled=args.compile_layers)
        if args.liger != "off":
            result["correctness"].update(check_correctness(args.sliding_window, liger=True, compiled=args.compile_layers))
    print(json.dumps(result), flush=True)
    base_model = build_model(args.model, args.sliding_window)
    settings = {"off": [False], "on": [True], "both": [False, True]}[args.liger]
    models = {liger: (copy.deepcopy(base_model), copy.deepcopy(base_model)) for liger in settings}  # (base, zorro)
    del base_model
    for liger in settings:
        if liger:
            result["liger_modules"] = [apply_liger(m).summary() for m in models[liger]][0]
        for side, model in zip(("base", "zorro"), models[liger]):
            if args.checkpointing == "none" or (side == "zorro" and args.checkpointing == "base"):
                model.gradient_checkpointing_disable()
            elif args.checkpointing == "selective":
                enable_checkpointing(model, "selective")
        if args.compile_layers:
            for m in models[liger]:
                compile_layers(m)
    for case in json.loads(args.cases):
        for liger in settings:
            row = run_case(case, args.model, *models[liger], args)
            result["rows"].append({"liger": liger, **row})
            print(json.dumps(result["rows"][-1]), flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(markdown(result["rows"]))


if __name__ == "__main__":
    main()
