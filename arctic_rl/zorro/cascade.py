"""Cascade attention for a packed ZoRRo row on dense varlen kernels (GPU), exact in value and gradient.

The ZoRRo rule splits every query's visible keys into two disjoint sets (``masks.py``): its own
segment so far, and (response tokens only) its group's whole prompt. With the row laid out
prompts-first (``pack_shared_prompts(..., prompts_first=True)``)::

    [ prompt_1 | prompt_2 | ... | responses of group 1 | responses of group 2 | ... ]
      0 ............. Tp-1        Tp ....................................... T-1

both sets are plain variable-length attention problems with no mask at all:

* part A, every token over its own segment, causal: varlen with ``cu = segment boundaries``;
* part B, response tokens over their group's prompt, not causal: varlen with queries
  ``q[Tp:]`` split at group boundaries and keys ``k[:Tp]`` split at prompt boundaries.

Each runs on a stock fused kernel (torch's FlashAttention-2 varlen), and a response token's
two partial results are merged by their log-sum-exp: ``lse = logaddexp(lse_a, lse_b)``,
``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``. Backward needs no merge of its
own: a flash-style backward recomputes ``P = exp(S - lse)`` and ``D = rowsum(dO * out)``, so
running each part's backward kernel with the *merged* ``out`` and ``lse`` yields that part's exact
share of the gradient; ``dq`` adds both, ``dk``/``dv`` of prompt keys add part B's.

The kernels are torch's private ``aten._flash_attention_forward`` / ``_backward`` ops (the ones
behind ``torch.nn.attention.varlen``), checked against dense attention in ``tests/zorro/test_gpu.py``;
the merge and split backward are checked in float64 on CPU with a plain-torch varlen kernel
(``tests/zorro/test_cascade.py``). cuDNN's ragged kernels were tried and dropped (BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class CascadePlan:
    """Varlen boundaries of a prompts-first packed row (int32 tensors on the row's device)."""

    num_prompt_tokens: int  # prompts occupy [0, Tp), responses [Tp, T)
    num_tokens: int
    cu_segments: torch.Tensor  # [S + 1] every segment (prompt or response) in row order
    max_segment: int
    cu_group_queries: torch.Tensor  # [n + 1] response tokens of each group, offsets from Tp
    max_group_queries: int
    cu_prompts: torch.Tensor  # [n + 1] each group's prompt
    max_prompt: int


def _runs(values: list[int]) -> list[int]:
    """Start offsets of runs of equal values, plus the end (``len(values)``)."""
    starts = [i for i in range(len(values)) if i == 0 or values[i] != values[i - 1]]
    return starts + [len(values)]


def cascade_plan(segment_ids: torch.Tensor, parent_ids: torch.Tensor) -> CascadePlan:
    """Plan of a prompts-first row without padding (``pack_shared_prompts(prompts_first=True)``)."""
    segments, parents = segment_ids.tolist(), parent_ids.tolist()
    if any(s < 0 for s in segments):
        raise ValueError("cascade attention needs a row without padding (pack with pad_to_multiple=1)")
    tp = sum(1 for p in parents if p < 0)
    if any(p >= 0 for p in parents[:tp]):
        raise ValueError("cascade attention needs a prompts-first row (pack with prompts_first=True)")
    seg_cu = _runs(segments)
    prompt_cu = _runs(segments[:tp])
    query_cu = _runs(parents[tp:])
    prompt_order = [segments[s] for s in prompt_cu[:-1]]
    query_order = [parents[tp + s] for s in query_cu[:-1]] if len(parents) > tp else []
    if prompt_order != query_order:
        raise ValueError(f"group order of responses {query_order} does not follow the prompts {prompt_order}")
    device = segment_ids.device

    def cu(offsets: list[int]) -> tuple[torch.Tensor, int]:
        longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
        return torch.tensor(offsets, dtype=torch.int32, device=device), longest

    cu_segments, max_segment = cu(seg_cu)
    cu_prompts, max_prompt = cu(prompt_cu)
    cu_queries, max_queries = cu(query_cu)
    return CascadePlan(tp, len(segments), cu_segments, max_segment, cu_queries, max_queries, cu_prompts, max_prompt)


class _Flash:
    """torch's FlashAttention-2 varlen kernels; GQA native; lse ``[H, T]``."""

    @staticmethod
    def forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        return out, lse.transpose(0, 1), (rng, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
        rng, unused = aux
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.transpose(0, 1).contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=scale,
        )


_KERNELS = {"flash": _Flash}


class CascadeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CascadePlan, scale: float, kernel):
        kernel = _KERNELS[kernel] if isinstance(kernel, str) else kernel
        tp = plan.num_prompt_tokens
        out_a, lse_a, aux_a = kernel.forward(
            q, k, v, plan.cu_segments, plan.cu_segments, plan.max_segment, plan.max_segment, True, scale
        )
        out, lse = out_a, lse_a
        aux_b = None
        if tp < plan.num_tokens:
            out_b, lse_b, aux_b = kernel.forward(
                q[tp:], k[:tp], v[:tp], plan.cu_group_queries, plan.cu_prompts, plan.max_group_queries,
                plan.max_prompt, False, scale,
            )
            acc = torch.promote_types(q.dtype, torch.float32)  # merge in fp32 (fp64 for fp64 inputs)
            lse_ra, lse_rb = lse_a[tp:].to(acc), lse_b.to(acc)
            lse_r = torch.logaddexp(lse_ra, lse_rb)
            merged = out_a[tp:].to(acc) * torch.exp(lse_ra - lse_r)[..., None]
            merged += out_b.to(acc) * torch.exp(lse_rb - lse_r)[..., None]
            out = torch.cat([out_a[:tp], merged.to(q.dtype)])
            lse = torch.cat([lse_a[:tp].to(acc), lse_r])
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.kernel, ctx.aux = plan, scale, kernel, (aux_a, aux_b)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale, kernel = ctx.plan, ctx.scale, ctx.kernel
        aux_a, aux_b = ctx.aux
        tp = plan.num_prompt_tokens
        dout = dout.contiguous()
        dq, dk, dv = kernel.backward(
            dout, q, k, v, out, lse, plan.cu_segments, plan.cu_segments, plan.max_segment, plan.max_segment, True,
            scale, aux_a,
        )
        if tp < plan.num_tokens:
            dq_b, dk_b, dv_b = kernel.backward(
                dout[tp:], q[tp:], k[:tp], v[:tp], out[tp:], lse[tp:], plan.cu_group_queries, plan.cu_prompts,
                plan.max_group_queries, plan.max_prompt, False, scale, aux_b,
            )
            dq[tp:] += dq_b
            dk[:tp] += dk_b
            dv[:tp] += dv_b
        return dq, dk, dv, None, None, None


class CascadeMask(torch.Tensor):
    """A ``[1, 1, 1, 1]`` marker tensor carrying a ``CascadePlan`` to the attention function.

    transformers passes any 4D tensor given as ``attention_mask`` straight to the attention
    function (and activation recomputation replays the same object), which is how the plan reaches
    every layer, in forward and in recomputed forwards, without new keyword arguments."""

    plan: CascadePlan

    @staticmethod
    def of(plan: CascadePlan, device: torch.device) -> "CascadeMask":
        mask = torch.Tensor._make_subclass(CascadeMask, torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device))
        mask.plan = plan
        return mask


def cascade_attention(q, k, v, plan: CascadePlan, scale: float, kernel="flash") -> torch.Tensor:
    """``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` of a prompts-first packed row -> ``out [T, Hq, D]``.

    ``kernel``: ``"flash"`` (torch's FlashAttention-2), or any object with the ``forward`` /
    ``backward`` static methods of ``_Flash`` (lse as ``[T, H]``)."""
    if isinstance(kernel, str) and kernel not in _KERNELS:
        raise ValueError(f"cascade kernel must be one of {tuple(_KERNELS)}, got {kernel!r}")
    return CascadeAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, kernel)
