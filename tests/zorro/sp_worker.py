"""One gloo rank of the sequence-parallel checks (``test_sequence_parallel.py``): every case runs the single-rank
ZoRRo forward and the sequence-parallel one on the same seeded tiny model and batch, and records how far the
log-probs, entropies, loss and gradients are apart.

    python tests/zorro/sp_worker.py RANK WORLD PORT OUT_JSON CASE [CASE ...]     # CASE: degree:family:dtype:dedup

``SP_DEVICE=cuda``: each rank on its own GPU over NCCL (the GPU test); default CPU over gloo.

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

DTYPES = {"float64": torch.float64, "float32": torch.float32}
DEVICE = os.environ.get("SP_DEVICE", "cpu")
# two prompt groups; the 2- and 4-way splits of the packed row fall inside the first group's responses, so
# responses on one rank attend to a prompt on another
BATCH = dict(prompt_lengths=[5, 3], prompt_of=[0, 0, 0, 1, 1], response_lengths=[4, 2, 3, 5, 1])
# a tree batch: a response continuing another's first tokens shares them (prefix_tree.py)
TREE_BATCH = dict(prompt_lengths=[5, 3], prompt_of=[0, 0, 1, 1, 1], response_lengths=[4, 4, 3, 5, 2])


def batch_for(dedup: str, device: torch.device):
    prompts, response_ids, mask = make_batch(**(TREE_BATCH if dedup == "tree" else BATCH), seed=1, device=device)
    if dedup == "tree":  # sample 1 repeats sample 0's first two response tokens, sample 4 sample 3's first one
        response_ids[1, :2] = response_ids[0, :2]
        response_ids[4, :1] = response_ids[3, :1]
    return prompts, response_ids, mask


def run(model, dedup: str, sp: SequenceParallel | None):
    prompts, response_ids, mask = batch_for(dedup, next(model.parameters()).device)
    logprobs, entropy = zorro_response_logprobs(model, prompts, response_ids, mask, 0.7, True, 0, attention_backend="sdpa",
                                                dedup=dedup, sequence_parallel=sp)
    weights = torch.linspace(-1.0, 1.0, logprobs.numel(), dtype=logprobs.dtype).view_as(logprobs)
    loss = (logprobs * weights).sum() + 0.3 * (entropy * mask).sum()  # reaches every log-prob and entropy
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return logprobs.detach(), entropy.detach(), loss.detach(), grads


def check(case: str, groups: dict[int, SequenceParallel]) -> dict:
    degree, kind, dtype, dedup = case.split(":")
    sp = groups[int(degree)]
    eager = kind in ("gemma2", "gpt_oss")  # soft-cap / sinks: transformers builds these on their eager function only
    device = f"cuda:{dist.get_rank()}" if DEVICE == "cuda" else "cpu"
    # 4 query, 2 key/value heads: on 4 ranks each key/value head twice
    model = build_tiny(kind, dtype=DTYPES[dtype], device=device, attn_implementation="eager" if eager else "sdpa")
    single = run(twin(model), dedup, None)
    rows_seen: list[int] = []  # how many rows of the packed row this rank's decoder ran
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[-1]))
    split = run(model, dedup, sp)
    hook.remove()
    grads = split[3].clone()
    dist.all_reduce(grads, group=sp.group)
    grads /= sp.size
    return {
        "logprobs": (split[0] - single[0]).abs().max().item(),
        "entropy": (split[1] - single[1]).abs().max().item(),
        "loss": abs(split[2].item() - single[2].item()),
        "grads": (grads - single[3]).abs().max().item(),
        "grad_scale": single[3].abs().max().item(),
        "rank_grad_share": (split[3] - single[3]).abs().max().item(),  # one rank alone is NOT the gradient
        "nonzero_logprobs": int((single[0] != 0).sum()),
        "rows_per_rank": rows_seen[0],  # the packed forward (head_transform then probes the model on its own)
    }


if __name__ == "__main__":
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    degrees = sorted({int(case.split(":")[0]) for case in sys.argv[5:]})
    groups = {degree: SequenceParallel.consecutive_groups(degree) for degree in degrees}
    results = {case: check(case, groups) for case in sys.argv[5:]}
    if rank == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
