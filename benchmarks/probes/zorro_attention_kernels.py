"""Per-layer attention fwd+bwd (bf16, 16/8 heads x 128) of the ZoRRo layouts of the benchmark cases:
cascade attention on cuDNN in dense batches (``cudnn``) and on torch's FlashAttention-2 varlen (``flash``),
both on the prompts-first row, FlexAttention with
the ZoRRo block mask (``flex``, default compile, interleaved row padded to 128), and the naive dense batch
through SDPA (cuDNN) for reference rates. TFLOP/s count allowed query-key pairs only (bwd = 2.5x fwd).

    PYTHONPATH=$PWD python3 benchmarks/probes/zorro_attention_kernels.py
"""

import json
import statistics

import torch
import torch.nn.functional as F

from arctic_rl.zorro.attention import compiled_flex_attention
from arctic_rl.zorro.cascade import cascade_attention, cascade_plan
from arctic_rl.zorro.masks import zorro_block_mask

DEV = "cuda"
HQ, HKV, D = 16, 8, 128


def layout(n, g, p, r, prompts_first):
    """segment / parent ids of n groups, each a prompt of p and g responses of r tokens."""
    prompt_runs, response_runs, sid = [], [], 0
    for _ in range(n):
        ps = sid
        prompt_runs.append(([sid] * p, [-2] * p))
        sid += 1
        group = []
        for _ in range(g):
            group.append(([sid] * r, [ps] * r))
            sid += 1
        response_runs.append(group)
    runs = prompt_runs + [x for grp in response_runs for x in grp] if prompts_first else [
        x for pr, grp in zip(prompt_runs, response_runs) for x in [pr] + grp]
    seg = [s for run in runs for s in run[0]]
    par = [q for run in runs for q in run[1]]
    return torch.tensor(seg, dtype=torch.int32, device=DEV), torch.tensor(par, dtype=torch.int32, device=DEV)


def bench(fn, warm=2, iters=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}))
    scale = D**-0.5
    for n, g, p, r in [[2, 8, 4096, 512], [2, 8, 1024, 1024], [1, 16, 8192, 1024], [1, 16, 16384, 2048]]:
        row = {"case": [n, g, p, r]}
        pairs = n * (p * (p + 1) // 2 + g * (r * p + r * (r + 1) // 2))
        flops = 4 * HQ * D * pairs * 3.5
        for name in ("cudnn", "flash", "flex"):
            seg, par = layout(n, g, p, r, prompts_first=name != "flex")
            if name == "flex":
                pad = (-seg.shape[0]) % 128
                seg = torch.cat([seg, torch.full((pad,), -1, dtype=torch.int32, device=DEV)])
                par = torch.cat([par, torch.full((pad,), -2, dtype=torch.int32, device=DEV)])
            t = seg.shape[0]
            q, k, v = (torch.randn(t, h, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV))
            up = torch.randn(t, HQ, D, device=DEV, dtype=torch.bfloat16)
            if name == "flex":
                mask, flex = zorro_block_mask(seg, par, 128), compiled_flex_attention()

                def fwd():
                    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
                    return flex(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
            else:
                plan = cascade_plan(seg, par)

                def fwd(plan=plan, kernel=name):
                    return cascade_attention(q, k, v, plan, scale, kernel)
            ms = bench(lambda: torch.autograd.backward(fwd(), up))
            row[name] = {"fwdbwd_ms": round(ms, 3), "TFLOPs": round(flops / ms / 1e9, 1)}
        seqs, s = n * g, p + r
        qn, kn, vn = (torch.randn(seqs, HQ, s, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        ms = bench(lambda: torch.autograd.backward(F.scaled_dot_product_attention(qn, kn, vn, is_causal=True), qn), 1, 3)
        row["naive_sdpa"] = {"fwdbwd_ms": round(ms, 3), "TFLOPs": round(4 * HQ * D * seqs * s * (s + 1) // 2 * 3.5 / ms / 1e9, 1)}
        del qn, kn, vn
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
