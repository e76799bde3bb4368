"""One gloo rank of the sequence-parallel checks (``test_sequence_parallel.py``): every case runs the single-rank
ZoRRo forward and the sequence-parallel one on the same seeded tiny model and batch, and records how far the
log-probs, entropies, loss and gradients are apart.

    python tests/zorro/sp_worker.py RANK WORLD PORT OUT_JSON CASE [CASE ...]     # CASE: degree:family:dtype:dedup[:backend]

``backend`` is the ZoRRo attention backend (``sdpa`` unless given); both runs of a case use it. ``flex`` on the CPU runs
eager FlexAttention forward only (torch has no FlexAttention backward on the CPU): log-probs and entropies are compared,
not gradients.

``SP_DEVICE=cuda``: each rank on its own GPU over NCCL; ``SP_DEVICE=cuda_shared``: every rank on GPU 0 over gloo (the
exchange goes through host memory), so the GPU backends are checked on one device; default CPU over gloo.

A case of degree N runs on the world split into groups of N consecutive ranks (``SequenceParallel.consecutive_groups``),
so one spawn of 4 ranks serves the 2- and the 4-rank cases.

Gradients: every rank's loss is the whole batch's (the values are gathered), so the ranks' parameter gradients
sum to WORLD x the single-rank gradient; their mean (what data-parallel averaging takes) is compared. Rank 0
writes ``OUT_JSON``: per case the largest absolute differences and the sizes that make them meaningful.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from arctic_rl.zorro import zorro_response_logprobs
from arctic_rl.zorro.sequence_parallel import SequenceParallel
from tests.zorro.models import build_tiny, make_batch, twin

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICE = os.environ.get("SP_DEVICE", "cpu")
# two prompt groups; the 2- and 4-way splits of the packed row fall inside the first group's responses, so
# responses on one rank attend to a prompt on another
BATCH = dict(prompt_lengths=[5, 3], prompt_of=[0, 0, 0, 1, 1], response_lengths=[4, 2, 3, 5, 1])
# a long prompt: split 4 ways, ranks 0 and 1 hold only its inner rows, which predict no target (dedup "long": group)
LONG_PROMPT_BATCH = dict(prompt_lengths=[30, 3], prompt_of=[0, 0, 1], response_lengths=[2, 2, 2])
# a tree batch: a response continuing another's first tokens shares them (prefix_tree.py)
TREE_BATCH = dict(prompt_lengths=[5, 3], prompt_of=[0, 0, 1, 1, 1], response_lengths=[4, 4, 3, 5, 2])


def batch_for(dedup: str, device: torch.device, scale: int = 1):
    """The batch, its lengths times ``scale``: flex pads the row to a multiple of 128, so its cases use ``scale`` 8
    (a row of 184 or 192 tokens, padded to 256) and every rank still holds real tokens."""
    shape = {"tree": TREE_BATCH, "long": LONG_PROMPT_BATCH}.get(dedup, BATCH)
    shape = {k: v if k == "prompt_of" else [scale * n for n in v] for k, v in shape.items()}
    prompts, response_ids, mask = make_batch(**shape, seed=1, device=device)
    if dedup == "tree":  # sample 1 repeats sample 0's first two response tokens, sample 4 sample 3's first one
        response_ids[1, : 2 * scale] = response_ids[0, : 2 * scale]
        response_ids[4, :scale] = response_ids[3, :scale]
    return prompts, response_ids, mask


def run(model, dedup: str, sp: SequenceParallel | None, backend: str, backward: bool):
    prompts, response_ids, mask = batch_for(dedup, next(model.parameters()).device, 8 if backend == "flex" else 1)
    with torch.set_grad_enabled(backward):
        logprobs, entropy = zorro_response_logprobs(model, prompts, response_ids, mask, 0.7, True, 0, attention_backend=backend,
                                                    dedup="group" if dedup == "long" else dedup, sequence_parallel=sp)
        weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=logprobs.dtype).view_as(logprobs)
        loss = (logprobs * weights).sum() + 0.3 * (entropy * mask).sum()  # reaches every log-prob and entropy
    if not backward:
        return logprobs, entropy, loss, None
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    grads = grads.float() if grads.dtype == torch.bfloat16 else grads
    return logprobs.detach(), entropy.detach(), loss.detach(), grads


def check(case: str, groups: dict[int, SequenceParallel]) -> dict:
    degree, kind, dtype, dedup, backend = (case.split(":") + ["sdpa"])[:5]
    sp = groups[int(degree)]
    eager = kind in ("gemma2", "gpt_oss")  # soft-cap / sinks: transformers builds these on their eager function only
    device = {"cuda": f"cuda:{dist.get_rank()}", "cuda_shared": "cuda:0"}.get(DEVICE, "cpu")
    backward = not (backend == "flex" and device == "cpu")
    # 4 query, 2 key/value heads: on 4 ranks each key/value head twice
    model = build_tiny(kind, dtype=DTYPES[dtype], device=device, attn_implementation="eager" if eager else "sdpa")
    single = run(twin(model), dedup, None, backend, backward)
    rows_seen: list[int] = []  # how many rows of the packed row this rank's decoder ran
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[-1]))
    split = run(model, dedup, sp, backend, backward)
    hook.remove()
    result = {
        "backend": backend,
        "logprobs": (split[0] - single[0]).abs().max().item(),
        "entropy": (split[1] - single[1]).abs().max().item(),
        "loss": abs(split[2].item() - single[2].item()),
        "nonzero_logprobs": int((single[0] != 0).sum()),
        "rows_per_rank": rows_seen[0],  # the packed forward (head_transform then probes the model on its own)
    }
    if backward:
        grads = split[3].cpu()
        dist.all_reduce(grads, group=sp.group)
        grads = grads.to(split[3].device) / sp.size
        result.update(grads=(grads - single[3]).abs().max().item(), grad_scale=single[3].abs().max().item(),
                      rank_grad_share=(split[3] - single[3]).abs().max().item())  # one rank alone is NOT the gradient
    return result


if __name__ == "__main__":
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    if DEVICE == "cpu":  # FlexAttention compiled needs a GPU: the eager kernel (same math) on the CPU
        from torch.nn.attention.flex_attention import flex_attention

        from arctic_rl.zorro import attention

        attention.compiled_flex_attention = lambda: flex_attention
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    degrees = sorted({int(case.split(":")[0]) for case in sys.argv[5:]})
    groups = {degree: SequenceParallel.consecutive_groups(degree) for degree in degrees}
    results = {case: check(case, groups) for case in sys.argv[5:]}
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    # every rank done before any tears its connections down: a gloo peer closed while another still holds pairs to it
    # aborts that process ("terminate called without an active exception"), as seen after forward-only cases
    dist.barrier()
    dist.destroy_process_group()
