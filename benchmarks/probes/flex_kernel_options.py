"""FlexAttention kernel options on the ZoRRo block mask, per layer fwd+bwd in ms (bf16, 16/8 heads x
128): default compile (made dynamic by a second length first, as in training) with and without
``IS_DIVISIBLE`` / ``ROWS_GUARANTEED_SAFE`` / ``USE_TMA``, and a static-shape compile.

    PYTHONPATH=$PWD python3 benchmarks/probes/flex_kernel_options.py
"""
import json, torch, torch._dynamo
from benchmarks.probes.zorro_attention_kernels import bench
from torch.nn.attention.flex_attention import flex_attention
from arctic_rl.zorro.masks import zorro_block_mask
dev = "cuda"
torch._dynamo.config.cache_size_limit = 64
def layout(n, G, P, R, extra=0):
    seg, par, sid = [], [], 0
    for _ in range(n):
        ps = sid; seg += [sid] * P; par += [-2] * P; sid += 1
        for _ in range(G):
            seg += [sid] * R; par += [ps] * R; sid += 1
    seg += [-1] * ((-len(seg)) % 128 + extra); par += [-2] * ((-len(par)) % 128 + extra)
    return torch.tensor(seg, dtype=torch.int32, device=dev), torch.tensor(par, dtype=torch.int32, device=dev)
hq, hkv, d = 16, 8, 128
variants = {"auto": ({}, {}), "auto_div": ({}, {"IS_DIVISIBLE": True}), "auto_div_safe": ({}, {"IS_DIVISIBLE": True, "ROWS_GUARANTEED_SAFE": True}),
            "auto_div_tma": ({}, {"IS_DIVISIBLE": True, "USE_TMA": True}), "static": ({"dynamic": False}, {}), "static_tma": ({"dynamic": False}, {"USE_TMA": True})}
for name, (ckw, kopt) in variants.items():
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, **ckw)
    row = {"variant": name}
    try:
        for case in ([2, 8, 4096, 512], [2, 8, 1024, 1024], [1, 16, 8192, 1024]):
            seg, par = layout(*case)
            T = seg.shape[0]
            q = torch.randn(1, hq, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, hkv, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, hkv, T, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
            g = torch.randn(1, hq, T, d, device=dev, dtype=torch.bfloat16)
            bm = zorro_block_mask(seg, par, 128)
            if name.startswith("auto"):  # make the compile dynamic first, as a real run does
                seg2, par2 = layout(*case, extra=256)
                q2 = torch.randn(1, hq, seg2.shape[0], d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                k2 = torch.randn(1, hkv, seg2.shape[0], d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                for qq, kk, bb in ((q, k, bm), (q2, k2, zorro_block_mask(seg2, par2, 128))):
                    flex(qq, kk, kk, block_mask=bb, enable_gqa=True, kernel_options=kopt).sum().backward()
            f = lambda: flex(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=kopt)
            row[str(case)] = round(bench(lambda: torch.autograd.backward(f(), g)), 3)
    except Exception as e:
        row["error"] = repr(e)[:400]
    print(json.dumps(row), flush=True)
