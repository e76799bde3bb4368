"""ZoRRo on a hybrid linear-attention model: fwd+bwd of response log-probs, deduplicated vs. naive,
on a Qwen3-Next-shaped model (random weights, bf16, gradient checkpointing on both sides).

Shape (``--model next``): Qwen3-Next-80B-A3B's layer widths (hidden 2048; full-attention layers with 16
query heads of 256 and 2 KV heads, gated output; gated DeltaNet layers with 16 key heads and 32 value heads
of 128, conv width 4; 3 DeltaNet : 1 full; MoE with 512-wide experts, top-10, a 512-wide shared expert)
but 24 layers and 64 experts instead of 48 and 512, so weights and gradients fit one H200 (~6.3B
parameters, ~1.7B active per token).

baseline: ``response_logprobs``, the dense per-sequence batch ``[N*G, P+R]`` (SDPA for full attention;
          the model's own DeltaNet path: flash-linear-attention when installed, else torch).
zorro:    ``zorro_response_logprobs`` with FlexAttention for the full layers and the segmented DeltaNet
          (``arctic_rl/zorro/linear_attention.py``: fla varlen kernels with per-prompt initial states).
Same process, same weights.

FLOP model (training = 3x forward, no recompute), per token unless said:
* matmuls: 2 x parameters touched per token (full-attention projections, DeltaNet projections, the
  router, the top-k experts and the shared expert), and the output head on the M response rows.
* full attention (1 layer in 4): ``4 Hq D`` per allowed query-key pair, x3.5 for training as in
  ``zorro_train.py``. Pairs: naive ``N G S(S+1)/2``; ZoRRo ``N [P(P+1)/2 + G (P R + R(R+1)/2)]``.
* gated DeltaNet (3 layers in 4), chunked with chunk ``C = 64``, per value head (``dk = dv = 128``):
  the state reads/writes ``q S``, ``k_cumdecay S`` and ``k^T v_new`` cost ``3 x 2 dk dv``; within a chunk
  ``q k^T`` and ``k_beta k^T`` cost ``2 x 2 C dk``, ``attn v_new`` ``2 C dv``, the two triangular solves
  ``C (dk + dv)``: ``f_lin = 6 dk dv + C (5 dk + 3 dv)`` per token and head, linear in length (plus
  the width-4 conv, ``2 x 4`` per channel). Nothing quadratic: these layers' cost follows the token
  count, so they save exactly the token ratio.

So the achievable FLOP ratio is ``F_naive / F_zorro`` with ``F = (a + l) T + b A + h M``: ``a`` the
per-token matmul FLOPs of all layers, ``l`` the DeltaNet per-token term, ``T`` tokens, ``A`` attention
pairs of the full layers only, ``M`` response rows. A dense model's ratio is pulled below the token
ratio by its attention pairs on *every* layer (ZoRRo cannot dedupe the response-to-prompt pairs); here
only one layer in four has pairs, so the ratio sits closer to the token ratio (printed per case).

    python benchmarks/zorro_hybrid.py --out benchmarks/results/zorro_hybrid_h200.json   # both cases, H200
    python benchmarks/zorro_hybrid.py --model tiny --cases '[[2,4,128,32]]' --iters 2    # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from arctic_rl.modules.models import response_logprobs  # noqa: E402
from arctic_rl.zorro import zorro_response_logprobs  # noqa: E402
from benchmarks.zorro_train import make_batch, measure  # noqa: E402

SHAPES = {
    "next": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                 linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, intermediate_size=5120, vocab_size=151936),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64, intermediate_size=256, vocab_size=1000),
}
CASES = [[2, 8, 4096, 512], [1, 16, 8192, 1024]]
CHUNK = 64  # transformers' and fla's delta-rule chunk
PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on this H200 kind (zorro_train.py)


def build_model(shape: str) -> torch.nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**SHAPES[shape], full_attention_interval=4, max_position_embeddings=65536,
                             decoder_sparse_step=1, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3NextForCausalLM(config).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def per_token_flops(shape: dict) -> dict[str, float]:
    """Forward FLOPs per token of one full-attention layer's matmuls, one DeltaNet layer's matmuls and
    recurrence, one MoE block, and the attention FLOPs per allowed pair (module docstring)."""
    h, hq, d, hkv = shape["hidden_size"], shape["num_attention_heads"], shape["head_dim"], shape["num_key_value_heads"]
    nk, nv, dk, dv = (shape[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"))
    full = 2 * (h * 2 * hq * d + 2 * h * hkv * d + hq * d * h)
    linear_proj = 2 * (h * (2 * nk * dk + 2 * nv * dv) + h * 2 * nv + nv * dv * h)
    recurrence = nv * (6 * dk * dv + CHUNK * (5 * dk + 3 * dv)) + 2 * shape["linear_conv_kernel_dim"] * (2 * nk * dk + nv * dv)
    moe = 2 * (h * shape["num_experts"] + 3 * h * shape["moe_intermediate_size"] * shape["num_experts_per_tok"]
               + 3 * h * shape["shared_expert_intermediate_size"] + h)
    return dict(full=full, linear=linear_proj + recurrence, recurrence=recurrence, moe=moe, pair=4 * hq * d)


def work(case: list[int], shape: dict) -> dict:
    """Tokens, attention pairs and training FLOPs of both sides, and their ratios."""
    n, g, p, r = case
    s = p + r
    layers = shape["num_hidden_layers"]
    n_full = layers // 4
    f = per_token_flops(shape)
    rows = n * g * r

    def flops(tokens: int, pairs: int) -> float:
        per_token = n_full * f["full"] + (layers - n_full) * f["linear"] + layers * f["moe"]
        return 3 * per_token * tokens + 3.5 * f["pair"] * pairs * n_full + 3 * 2 * shape["hidden_size"] * shape["vocab_size"] * rows

    tokens_naive, tokens_dedup = n * g * s, n * (p + g * r)
    pairs_naive = n * g * s * (s + 1) // 2
    pairs_dedup = n * (p * (p + 1) // 2 + g * (p * r + r * (r + 1) // 2))
    fn, fd = flops(tokens_naive, pairs_naive), flops(tokens_dedup, pairs_dedup)
    return dict(tokens_naive=tokens_naive, tokens_dedup=tokens_dedup, token_ratio=round(tokens_naive / tokens_dedup, 3),
                flops_naive=fn, flops_dedup=fd, flop_ratio=round(fn / fd, 3),
                dense_pairs_ratio=round(pairs_naive / pairs_dedup, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next", choices=sorted(SHAPES))
    parser.add_argument("--cases", type=json.loads, default=CASES, help="[[prompts, G, prompt_len, response_len], ...]")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import importlib.util

    model = build_model(args.model)
    shape = SHAPES[args.model]
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                fla=importlib.util.find_spec("fla") is not None, model=args.model,
                parameters=sum(p.numel() for p in model.parameters()))
    print(json.dumps(info), flush=True)
    rows = []
    for case in args.cases:
        batch = make_batch(*case, shape["vocab_size"])
        row = dict(case=case, **work(case, shape))
        for side, fn, kw, warm in (("base", response_logprobs, {}, 1),
                                   ("zorro", zorro_response_logprobs, {"attention_backend": "flex"}, 2)):
            try:
                t, mem, times = measure(fn, model, batch, warm, args.iters, **kw)
                flops = row["flops_naive" if side == "base" else "flops_dedup"]
                row.update({f"{side}_s": round(t, 4), f"{side}_mem_gib": round(mem, 1), f"{side}_times": [round(x, 4) for x in times],
                            f"{side}_mfu": round(flops / t / PEAK_TFLOPS / 1e12, 3)})
            except torch.OutOfMemoryError:
                row[f"{side}_s"] = "OOM"
            torch.cuda.empty_cache()
        if isinstance(row.get("base_s"), float) and isinstance(row.get("zorro_s"), float):
            row["speedup"] = round(row["base_s"] / row["zorro_s"], 2)
            row["speedup_of_flop_ratio"] = round(row["speedup"] / row["flop_ratio"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
