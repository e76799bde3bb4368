"""What a never-seen packed layout costs each ZoRRo attention backend (bf16, 16/8 heads x 128, one
layer fwd+bwd): the first call on a new ragged layout (kernel compilation, cuDNN graph builds) against
the same layout again. A training run meets a new layout every micro-batch; the first layer pays the
build, the other layers reuse it. Layouts: 4 groups, prompts of 300-3000 tokens, 8 responses of
50-1500 tokens each (seeded).

    PYTHONPATH=$PWD python3 benchmarks/probes/cascade_new_layouts.py
"""

import json
import random
import time

import torch

from arctic_rl.zorro.attention import compiled_flex_attention
from arctic_rl.zorro.cascade import cascade_attention, cascade_plan
from arctic_rl.zorro.masks import zorro_block_mask
from arctic_rl.zorro.packing import pack_shared_prompts

DEV = "cuda"
HQ, HKV, D = 16, 8, 128


def ragged_layout(seed: int, prompts_first: bool, pad: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for g in range(4):
        prompt = [g + 1] * rng.randint(300, 3000)
        for _ in range(8):
            prompts.append(prompt)
            lengths.append(rng.randint(50, 1500))
    ids = torch.ones(len(lengths), max(lengths), dtype=torch.long)
    return pack_shared_prompts(prompts, ids, lengths, pad_to_multiple=pad, prompts_first=prompts_first)


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def main():
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cudnn": torch.backends.cudnn.version()}))
    scale = D**-0.5
    for backend in ("cudnn", "flash", "flex"):
        for step in range(4):
            layout = ragged_layout(step, backend != "flex", 128 if backend == "flex" else 1)
            seg, par = layout.segment_ids.to(DEV), layout.parent_ids.to(DEV)
            t = seg.shape[0]
            q, k, v = (torch.randn(t, h, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for h in (HQ, HKV, HKV))
            up = torch.randn(t, HQ, D, device=DEV, dtype=torch.bfloat16)
            plan_ms = timed(lambda: None)
            if backend == "flex":
                start = time.perf_counter()
                mask = zorro_block_mask(seg, par, 128)
                plan_ms = (time.perf_counter() - start) * 1e3

                def fwd():
                    qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
                    return compiled_flex_attention()(qt, kt, vt, block_mask=mask, scale=scale, enable_gqa=True,
                                                     kernel_options={"IS_DIVISIBLE": True})[0].transpose(0, 1)
            else:
                start = time.perf_counter()
                plan = cascade_plan(seg, par)
                plan_ms = (time.perf_counter() - start) * 1e3

                def fwd(plan=plan, kernel="cudnn" if backend == "cudnn" else "flash"):
                    return cascade_attention(q, k, v, plan, scale, kernel)

            step_fn = lambda: torch.autograd.backward(fwd(), up)  # noqa: E731
            first = timed(step_fn)
            again = sorted(timed(step_fn) for _ in range(3))[1]
            print(json.dumps({"backend": backend, "layout": step, "tokens": t, "plan_ms": round(plan_ms, 2),
                              "first_ms": round(first, 2), "again_ms": round(again, 2)}), flush=True)


if __name__ == "__main__":
    main()
