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

Each part runs on stock fused kernels, and a response token's two partial results are merged by
their log-sum-exp: ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b *
exp(lse_b - lse)``, done as one ``lerp`` with weight ``exp(lse_b - lse)`` (the weights sum to 1) in
fp32 and rounded to the kernels' dtype once. Backward needs no merge of its own: a flash-style
backward recomputes ``P = exp(S - lse)`` and ``D = rowsum(dO * out)``, so running each part's
backward kernel with the *merged* ``out`` and ``lse`` yields that part's exact share of the gradient;
``dq`` adds both, ``dk``/``dv`` of prompt keys add part B's.

Kernels (``cascade_attention(kernel=...)``):

* ``"cudnn"``: cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and its
  backward, the kernels behind SDPA's cuDNN backend) on *dense batches* (``DenseBatched``):
  sequences of equal length that sit back to back are one zero-copy ``[n, H, L, D]`` view; others
  are gathered into right-padded batches, which is exact for causal attention (a query never sees
  the padding after it) and, for part B, pads queries only. Fastest on regular layouts; cuDNN
  builds a graph for each new batch shape (BENCHMARKS.md has the cost).
* ``"flash"``: torch's FlashAttention-2 varlen (``aten._flash_attention_forward`` / ``_backward``,
  behind ``torch.nn.attention.varlen``): one call per part for any raggedness, no shape builds.

Both are checked against dense attention in ``tests/zorro/test_gpu.py``; the merge, the split
backward and the dense batching are checked in float64 on CPU with plain-torch stand-ins
(``tests/zorro/test_cascade.py``). cuDNN's ragged (varlen) mode was tried and dropped: its
backward was wrong (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import torch

from arctic_rl.checkpointing import active_tape

DENSE_PAD = 64  # padded batch lengths are rounded up to this (fewer distinct kernel shapes)
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VarlenPart:
    """Sequence ``i`` of one part: query rows ``[q_starts[i], +q_lens[i])`` attend key rows
    ``[k_starts[i], +k_lens[i])`` (offsets into the tensors the part is applied to); causal parts
    have ``q == k`` rows. Host tuples plan dense batches; ``cu_*`` feed varlen kernels."""

    q_starts: tuple[int, ...]
    q_lens: tuple[int, ...]
    k_starts: tuple[int, ...]
    k_lens: tuple[int, ...]
    cu_q: torch.Tensor  # [n + 1] int32 (rows of a part are contiguous runs, in order)
    cu_k: torch.Tensor
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_k(self) -> int:
        return max(self.k_lens, default=0)

    @staticmethod
    def of(q_offsets: list[int], k_offsets: list[int], device: torch.device) -> "VarlenPart":
        cu = lambda offsets: torch.tensor(offsets, dtype=torch.int32, device=device)  # noqa: E731
        return VarlenPart(
            tuple(q_offsets[:-1]), tuple(b - a for a, b in zip(q_offsets, q_offsets[1:])),
            tuple(k_offsets[:-1]), tuple(b - a for a, b in zip(k_offsets, k_offsets[1:])), cu(q_offsets), cu(k_offsets),
        )


@dataclass(frozen=True)
class CascadePlan:
    """The two parts of a prompts-first packed row: ``own`` (every segment over itself, causal;
    all ``T`` rows) and ``cross`` (each group's responses, rows from ``Tp``, over its prompt)."""

    num_prompt_tokens: int  # prompts occupy [0, Tp), responses [Tp, T)
    num_tokens: int
    own: VarlenPart
    cross: VarlenPart


def cascade_plan(segment_ids: torch.Tensor, parent_ids: torch.Tensor) -> CascadePlan:
    """Plan of a prompts-first row without padding (``pack_shared_prompts(prompts_first=True)``).
    Works on runs (one per prompt / response), not per token: ``O(T)`` only inside torch."""
    segments, parents = segment_ids.cpu(), parent_ids.cpu()
    run_segment, run_length = torch.unique_consecutive(segments, return_counts=True)
    starts = (torch.cumsum(run_length, 0) - run_length).tolist()
    run_segment, run_length, run_parent = run_segment.tolist(), run_length.tolist(), parents[starts].tolist()
    if any(s < 0 for s in run_segment):
        raise ValueError("cascade attention needs a row without padding (pack with pad_to_multiple=1)")
    num_prompts = next((i for i, p in enumerate(run_parent) if p >= 0), len(run_parent))
    if any(p < 0 for p in run_parent[num_prompts:]):
        raise ValueError("cascade attention needs a prompts-first row (pack with prompts_first=True)")
    tp = sum(run_length[:num_prompts])
    seg_cu = starts + [tp + sum(run_length[num_prompts:])]
    prompt_order = run_segment[:num_prompts]
    # responses of one group are consecutive runs with the same parent; group boundaries in [Tp, T)
    query_cu, query_order = [], []
    for start, parent in zip(starts[num_prompts:], run_parent[num_prompts:]):
        if not query_order or parent != query_order[-1]:
            query_cu.append(start - tp)
            query_order.append(parent)
    if prompt_order != query_order and query_order:
        raise ValueError(f"group order of responses {query_order} does not follow the prompts {prompt_order}")
    prompt_cu = seg_cu[: num_prompts + 1]
    if not query_order:  # no response tokens: no cross part
        query_cu, prompt_cu = [0], [0]
    else:
        query_cu.append(seg_cu[-1] - tp)
    device = segment_ids.device
    return CascadePlan(tp, seg_cu[-1], VarlenPart.of(seg_cu, seg_cu, device), VarlenPart.of(query_cu, prompt_cu, device))


class _Flash:
    """torch's FlashAttention-2 varlen kernels; GQA native; lse ``[T, H]``."""

    @staticmethod
    def forward(q, k, v, part: VarlenPart, causal, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0, causal, False, scale=scale
        )
        return out, lse.transpose(0, 1), (rng, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, part: VarlenPart, causal, scale, aux):
        rng, unused = aux
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.transpose(0, 1).contiguous(), part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0,
            causal, rng, unused, scale=scale,
        )


class GraphShapes:
    """The distinct batch shapes cuDNN has been asked for in this process. torch keys cuDNN's graph
    cache by shapes and strides, and each new key costs a one-off graph build (tens of ms, forward
    and backward). Past ``warn_at`` shapes it warns once: a ragged workload keeps meeting new
    shapes, and ``flex`` serves it without builds (BENCHMARKS.md)."""

    def __init__(self, warn_at: int = 64):
        self.warn_at = warn_at
        self.seen: set[tuple] = set()
        self.warned = False

    def note(self, *tensors: torch.Tensor, causal: bool) -> None:
        key = (causal, *((tuple(t.shape), t.stride(), t.dtype) for t in tensors))
        if key in self.seen:
            return
        self.seen.add(key)
        if len(self.seen) >= self.warn_at and not self.warned:
            self.warned = True
            logger.warning(
                "attention_backend='cudnn' has met %d distinct attention shapes; each costs a one-off cuDNN graph "
                "build. Prompt / response lengths look ragged: attention_backend='flex' (the default) needs no builds",
                len(self.seen),
            )


CUDNN_SHAPES = GraphShapes()


class CudnnDense:
    """cuDNN's fused attention on a dense batch ``[B, H, L, D]`` (strided views allowed; GQA
    native); returns ``lse [B, H, L]`` fp32. The backward takes the ``out`` / ``lse`` it is given."""

    @staticmethod
    def forward(q, k, v, causal, scale):
        CUDNN_SHAPES.note(q, k, causal=causal)
        out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return out, lse.squeeze(-1), (cu_q, cu_k, max_q, max_k, seed, offset)

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux):
        cu_q, cu_k, max_q, max_k, seed, offset = aux
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0,
            causal, scale=scale,
        )


@dataclass(frozen=True)
class _Batch:
    """Sequences of a part run as one dense ``[n, H, q_len, D]`` call. ``view``: the rows are
    already that batch (equal lengths, back to back, no padding): ``(q_row0, k_row0)``, no copies.
    Otherwise rows are gathered into a zero-padded batch: ``q_src`` rows go to ``q_dst`` slots."""

    n: int
    q_len: int
    k_len: int
    view: tuple[int, int] | None
    q_src: torch.Tensor | None = None
    q_dst: torch.Tensor | None = None
    k_src: torch.Tensor | None = None
    k_dst: torch.Tensor | None = None


def dense_batches(part: VarlenPart, causal: bool, device: torch.device) -> list[_Batch]:
    """Group a part's sequences into few dense calls, each exact:

    * causal (``own``): sequences sorted by length, a batch takes lengths above half its longest,
      right-padded to a multiple of ``DENSE_PAD``. A causal query never sees the padding after it,
      and padded query rows are dropped.
    * not causal (``cross``): one batch per distinct key length (keys cannot be padded without a
      mask), queries right-padded.
    Cached on the part: every layer and pass reuses it."""
    key = ("dense", causal)
    if key in part._cache:
        return part._cache[key]
    live = [i for i in range(len(part.q_lens)) if part.q_lens[i] and part.k_lens[i]]
    groups: list[list[int]] = []
    if causal:
        for i in sorted(live, key=lambda i: -part.q_lens[i]):
            if groups and 2 * part.q_lens[i] > part.q_lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
    else:
        by_key: dict[int, list[int]] = {}
        for i in live:
            by_key.setdefault(part.k_lens[i], []).append(i)
        groups = list(by_key.values())
    batches = [_plan_batch(part, sorted(g), causal, device) for g in groups]
    part._cache[key] = batches
    return batches


def _plan_batch(part: VarlenPart, seqs: list[int], causal: bool, device: torch.device) -> _Batch:
    q_lens, k_lens = [part.q_lens[i] for i in seqs], [part.k_lens[i] for i in seqs]
    uniform = len(set(q_lens)) == 1 and len(set(k_lens)) == 1
    back_to_back = all(
        part.q_starts[b] == part.q_starts[a] + q_lens[0] and part.k_starts[b] == part.k_starts[a] + k_lens[0]
        for a, b in zip(seqs, seqs[1:])
    )
    if uniform and back_to_back and (q_lens[0], k_lens[0]) != (1, 1):  # cuDNN refuses s_q = s_kv = 1
        return _Batch(len(seqs), q_lens[0], k_lens[0], (part.q_starts[seqs[0]], part.k_starts[seqs[0]]))
    q_len = -(-max(q_lens) // DENSE_PAD) * DENSE_PAD
    k_len = q_len if causal else k_lens[0]

    def index(starts: list[int], lens: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
        dst = torch.cat([torch.arange(j * width, j * width + n) for j, n in enumerate(lens)])
        return src.to(device), dst.to(device)

    q_src, q_dst = index([part.q_starts[i] for i in seqs], q_lens, q_len)
    k_src, k_dst = (q_src, q_dst) if causal else index([part.k_starts[i] for i in seqs], k_lens, k_len)
    return _Batch(len(seqs), q_len, k_len, None, q_src, q_dst, k_src, k_dst)


class DenseBatched:
    """A varlen kernel (the ``_Flash`` interface) made of dense calls of ``dense`` (``CudnnDense``
    on GPU; a plain-torch stand-in in the CPU tests), batched by ``dense_batches``."""

    def __init__(self, dense):
        self.dense = dense

    @staticmethod
    def _to_batch(x: torch.Tensor, batch: _Batch, rows: str) -> torch.Tensor:
        """Rows of ``x [T, H, ...]`` -> ``[n, H, L, ...]`` (a view, or a zero-padded gather)."""
        length = batch.q_len if rows == "q" else batch.k_len
        if batch.view is not None:
            start = batch.view[0 if rows == "q" else 1]
            return x[start : start + batch.n * length].unflatten(0, (batch.n, length)).transpose(1, 2)
        src, dst = (batch.q_src, batch.q_dst) if rows == "q" else (batch.k_src, batch.k_dst)
        padded = x.new_zeros((batch.n * length, *x.shape[1:]))
        padded[dst] = x[src]
        return padded.unflatten(0, (batch.n, length)).transpose(1, 2)

    @staticmethod
    def _to_rows(y: torch.Tensor, batch: _Batch, rows: str, out: torch.Tensor) -> None:
        """Write ``y [n, H, L, ...]`` back into the rows of ``out [T, H, ...]``."""
        flat = y.transpose(1, 2).flatten(0, 1)
        if batch.view is not None:
            start = batch.view[0 if rows == "q" else 1]
            out[start : start + flat.shape[0]] = flat
        else:
            src, dst = (batch.q_src, batch.q_dst) if rows == "q" else (batch.k_src, batch.k_dst)
            out[src] = flat[dst]

    @staticmethod
    def _covers(batches: list[_Batch], q: torch.Tensor, k: torch.Tensor) -> bool:
        """One zero-copy batch spanning every query and key row: results need no reassembly."""
        b = batches[0] if len(batches) == 1 else None
        return b is not None and b.view == (0, 0) and b.n * b.q_len == q.shape[0] and b.n * b.k_len == k.shape[0]

    def forward(self, q, k, v, part: VarlenPart, causal, scale):
        batches = dense_batches(part, causal, q.device)
        covers = self._covers(batches, q, k)
        if not covers:
            out = q.new_zeros(q.shape)
            lse = torch.zeros(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        aux = []
        for batch in batches:
            o, l, a = self.dense.forward(
                self._to_batch(q, batch, "q"), self._to_batch(k, batch, "k"), self._to_batch(v, batch, "k"), causal, scale
            )
            if covers:
                return o.transpose(1, 2).flatten(0, 1), l.transpose(1, 2).flatten(0, 1), [a]
            self._to_rows(o, batch, "q", out)
            self._to_rows(l.unsqueeze(-1), batch, "q", lse.unsqueeze(-1))
            aux.append(a)
        return out, lse, aux

    def backward(self, dout, q, k, v, out, lse, part: VarlenPart, causal, scale, aux):
        batches = dense_batches(part, causal, q.device)
        covers = self._covers(batches, q, k)
        if not covers:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for batch, a in zip(batches, aux):
            to_q = functools.partial(self._to_batch, batch=batch, rows="q")
            to_k = functools.partial(self._to_batch, batch=batch, rows="k")
            grads = self.dense.backward(
                to_q(dout), to_q(q), to_k(k), to_k(v), to_q(out), to_q(lse.unsqueeze(-1)).squeeze(-1), causal, scale, a
            )
            if covers:
                return tuple(g.transpose(1, 2).flatten(0, 1) for g in grads)
            for g, target, rows in zip(grads, (dq, dk, dv), "qkk"):
                self._to_rows(g, batch, rows, target)
        return dq, dk, dv


_KERNELS = {"flash": _Flash, "cudnn": DenseBatched(CudnnDense)}


class CascadeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: CascadePlan, scale: float, kernel, sinks, tape=None):
        kernel = _KERNELS[kernel] if isinstance(kernel, str) else kernel
        if tape is not None and tape.replaying:  # selective checkpointing's replay: the forward's result, kept
            out, lse, aux = tape.take()
            ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
            ctx.plan, ctx.scale, ctx.kernel, ctx.aux = plan, scale, kernel, aux
            return out.view_as(out)
        tp = plan.num_prompt_tokens
        out_a, lse_a, aux_a = kernel.forward(q, k, v, plan.own, True, scale)
        out, lse = out_a, lse_a  # fresh buffers of the kernel: merged in place
        aux_b = merged = None
        if tp < plan.num_tokens:
            out_b, lse_b, aux_b = kernel.forward(q[tp:], k[:tp], v[:tp], plan.cross, False, scale)
            lse_r = torch.logaddexp(lse_a[tp:], lse_b)  # fp32 (fp64 for fp64 inputs)
            weight_b = torch.exp(lse_b - lse_r)[..., None]
            # out_a * (1 - w_b) + out_b * w_b, in lse's precision and rounded once (below): a bf16 lerp with a bf16
            # weight added up to two more roundings per element (cudnn's error was 13% above naive's)
            merged = torch.lerp(out[tp:].to(lse.dtype), out_b.to(lse.dtype), weight_b)
            lse[tp:] = lse_r
        if sinks is not None:  # one more logit per head, value zero: every row's weights shrink by exp(lse - lse_s)
            lse_s = torch.logaddexp(lse, sinks.to(lse.dtype)[None])
            shrink = torch.exp(lse - lse_s)[..., None]
            if merged is not None:  # the merge and the shrink in lse's precision, rounded once
                out[tp:] = (merged * shrink[tp:]).to(out.dtype)
                out[:tp] = (out[:tp].to(lse.dtype) * shrink[:tp]).to(out.dtype)
            else:
                out.copy_(out.to(lse.dtype) * shrink)
            lse = lse_s
        elif merged is not None:
            out[tp:] = merged.to(out.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.plan, ctx.scale, ctx.kernel, ctx.aux = plan, scale, kernel, (aux_a, aux_b)
        if tape is not None:  # selective checkpointing's forward: kept for the replay (arctic_rl/checkpointing.py)
            tape.record((out.detach(), lse, (aux_a, aux_b)))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        plan, scale, kernel = ctx.plan, ctx.scale, ctx.kernel
        aux_a, aux_b = ctx.aux
        tp = plan.num_prompt_tokens
        dout = dout.contiguous()
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, plan.own, True, scale, aux_a)
        if tp < plan.num_tokens:
            dq_b, dk_b, dv_b = kernel.backward(
                dout[tp:], q[tp:], k[:tp], v[:tp], out[tp:], lse[tp:], plan.cross, False, scale, aux_b
            )
            dq[tp:] += dq_b
            dk[:tp] += dk_b
            dv[:tp] += dv_b
        dsinks = None
        if sinks:  # d out / d sink = -p_sink * out, so d loss / d sink = -sum over rows of p_sink * rowsum(dout * out)
            delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [T, H]
            dsinks = -(torch.exp(sinks[0].to(lse.dtype)[None] - lse) * delta).sum(0).to(sinks[0].dtype)
        return dq, dk, dv, None, None, None, dsinks, None


def cascade_attention(q, k, v, plan: CascadePlan, scale: float, kernel="flash", sinks=None) -> torch.Tensor:
    """``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` of a prompts-first packed row -> ``out [T, Hq, D]``.

    ``sinks [Hq]``: learned attention sinks (gpt-oss), one extra logit per head with a zero value,
    merged like a third part (``lse = logaddexp(lse, sink)``); the parts' backward kernels then run
    with the sink-including ``out`` / ``lse`` (so their probabilities are the true ones) and the
    sink's own gradient is ``-sum_rows exp(sink - lse) * rowsum(dout * out)``.

    ``kernel``: ``"flash"`` (torch's FlashAttention-2 varlen), ``"cudnn"`` (cuDNN's fused attention
    in dense batches, ``DenseBatched``), or any object with the ``forward`` / ``backward`` methods
    of ``_Flash`` (lse as ``[T, H]`` fp32)."""
    if isinstance(kernel, str) and kernel not in _KERNELS:
        raise ValueError(f"cascade kernel must be one of {tuple(_KERNELS)}, got {kernel!r}")
    return CascadeAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, kernel, sinks, active_tape())
