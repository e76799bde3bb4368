"""Cascade attention's own logic on CPU: the varlen plan of a prompts-first row, and the log-sum-exp
merge with its split backward, checked in float64 against dense masked attention.

The fused kernels (torch's FlashAttention-2 varlen ops) run only on CUDA; ``tests/zorro/test_gpu.py``
checks the whole backend there. Here ``ReferenceVarlen`` stands in for them: a plain-torch varlen
kernel with the same interface (forward returns ``out`` and ``lse``; backward takes the ``out`` and
``lse`` it is given, as a flash-style backward does), so the merge and the per-part backward with
the *merged* statistics are what is under test."""

import pytest
import torch

from arctic_rl.zorro.cascade import (
    DENSE_PAD,
    DenseBatched,
    GraphShapes,
    VarlenPart,
    cascade_attention,
    cascade_plan,
    dense_batches,
)
from arctic_rl.zorro.masks import allowed_pairs
from arctic_rl.zorro.packing import pack_shared_prompts

F64 = torch.float64


class ReferenceVarlen:
    """Varlen attention in plain torch, sequence by sequence (float64), flash-style backward."""

    @staticmethod
    def _pairs(part, causal):
        cu_q, cu_k = part.cu_q, part.cu_k
        for i in range(len(cu_q) - 1):
            q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            allowed = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            if causal:
                allowed = allowed.tril()
            yield slice(q0, q1), slice(k0, k1), allowed

    @staticmethod
    def _expand(k, hq):
        return k.repeat_interleave(hq // k.shape[1], dim=1)

    @staticmethod
    def forward(q, k, v, part, causal, scale):
        k, v = ReferenceVarlen._expand(k, q.shape[1]), ReferenceVarlen._expand(v, q.shape[1])
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[:2], dtype=q.dtype)
        for qs, ks, allowed in ReferenceVarlen._pairs(part, causal):
            s = torch.einsum("qhd,khd->hqk", q[qs], k[ks]) * scale
            s = s.masked_fill(~allowed, float("-inf"))
            lse[qs] = torch.logsumexp(s, -1).T
            out[qs] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[ks])
        return out, lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, part, causal, scale, aux):
        hq, hkv = q.shape[1], k.shape[1]
        ke, ve = ReferenceVarlen._expand(k, hq), ReferenceVarlen._expand(v, hq)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
        delta = (dout * out).sum(-1)  # [T, H]
        for qs, ks, allowed in ReferenceVarlen._pairs(part, causal):
            s = torch.einsum("qhd,khd->hqk", q[qs], ke[ks]) * scale
            p = torch.exp(s - lse[qs].T[..., None]).masked_fill(~allowed, 0.0)  # uses the lse it is given
            dp = torch.einsum("qhd,khd->hqk", dout[qs], ve[ks])
            ds = p * (dp - delta[qs].T[..., None])
            dv[ks] += torch.einsum("hqk,qhd->khd", p, dout[qs])
            dq[qs] += torch.einsum("hqk,khd->qhd", ds, ke[ks]) * scale
            dk[ks] += torch.einsum("hqk,qhd->khd", ds, q[qs]) * scale
        fold = lambda x: x.view(x.shape[0], hkv, hq // hkv, x.shape[-1]).sum(2)  # noqa: E731
        return dq, fold(dk), fold(dv)


class ReferenceDense:
    """A dense fused-attention kernel (the ``CudnnDense`` interface) in plain torch, float64:
    ``[B, H, L, D]`` batches, GQA, flash-style backward from the ``out`` / ``lse`` it is given."""

    @staticmethod
    def _scores(q, k, causal, scale):
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
        if causal:
            s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
        return s

    @staticmethod
    def forward(q, k, v, causal, scale):
        s = ReferenceDense._scores(q, k, causal, scale)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v), torch.logsumexp(s, -1), "aux"

    @staticmethod
    def backward(dout, q, k, v, out, lse, causal, scale, aux):
        assert aux == "aux"
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        p = torch.exp(ReferenceDense._scores(q, k, causal, scale) - lse[..., None])
        dp = torch.einsum("bhqd,bhkd->bhqk", dout, ve)
        ds = p * (dp - (dout * out).sum(-1)[..., None])
        dq = torch.einsum("bhqk,bhkd->bhqd", ds, ke) * scale
        fold = lambda x: x.unflatten(1, (k.shape[1], group)).sum(2)  # noqa: E731
        return dq, fold(torch.einsum("bhqk,bhqd->bhkd", ds, q) * scale), fold(torch.einsum("bhqk,bhqd->bhkd", p, dout))


def dense_attention(q, k, v, segment_ids, parent_ids, scale, sinks=None):
    """Masked dense attention; ``sinks [Hq]`` join as an extra key column with a zero value."""
    hq = q.shape[1]
    k, v = k.repeat_interleave(hq // k.shape[1], 1), v.repeat_interleave(hq // v.shape[1], 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~allowed_pairs(segment_ids, parent_ids)[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(hq, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1)
    return torch.einsum("hqk,khd->qhd", p if sinks is None else p[..., :-1], v)


def prompts_first_row(prompts, lengths):
    responses = torch.arange(1, 1 + len(lengths) * max(lengths)).view(len(lengths), -1)
    return pack_shared_prompts(prompts, responses, lengths, prompts_first=True)


def test_plan_of_a_prompts_first_row():
    # groups: p (3 tokens) with responses of 2, 0 and 3 tokens; q (2 tokens) with one response of 1
    layout = prompts_first_row([[1, 2, 3], [4, 5], [1, 2, 3], [1, 2, 3]], [2, 1, 0, 3])
    assert layout.segment_ids.tolist() == [0, 0, 0, 4, 4, 1, 1, 3, 3, 3, 5]
    plan = cascade_plan(layout.segment_ids, layout.parent_ids)
    assert (plan.num_prompt_tokens, plan.num_tokens) == (5, 11)
    assert plan.own.cu_q.tolist() == plan.own.cu_k.tolist() == [0, 3, 5, 7, 10, 11] and plan.own.max_q == 3
    assert plan.own.q_starts == (0, 3, 5, 7, 10) and plan.own.q_lens == (3, 2, 2, 3, 1)
    assert plan.cross.cu_k.tolist() == [0, 3, 5] and plan.cross.max_k == 3
    assert plan.cross.cu_q.tolist() == [0, 5, 6] and plan.cross.max_q == 5
    assert plan.own.cu_q.dtype == torch.int32


def test_plan_rejects_padding_and_interleaved_rows():
    prompts, ids = [[1, 2], [3]], torch.tensor([[7, 8], [9, 0]])
    with pytest.raises(ValueError, match="without padding"):
        cascade_plan(*_ids(pack_shared_prompts(prompts, ids, [2, 1], pad_to_multiple=8, prompts_first=True)))
    with pytest.raises(ValueError, match="prompts-first"):
        cascade_plan(*_ids(pack_shared_prompts(prompts, ids, [2, 1])))


def _ids(layout):
    return layout.segment_ids, layout.parent_ids


LAYOUTS = {  # prompts, response lengths
    "ragged": ([[1] * 7, [2] * 3, [1] * 7, [3] * 5, [1] * 7, [2] * 3], [4, 1, 6, 2, 1, 5]),
    "equal_lengths": ([[1] * 9, [2] * 9, [1] * 9, [2] * 9], [4, 4, 4, 4]),  # zero-copy dense views
    "equal_prompts_ragged_responses": ([[1] * 6, [2] * 6, [1] * 6, [2] * 6, [2] * 6], [3, 8, 5, 2, 70]),
    "one_group_no_sharing": ([[5] * 66], [3]),
    "one_token_segments": ([[7], [7], [8] * 3], [1, 1, 1]),  # padded: cuDNN refuses 1 x 1 attention
}
KERNELS = {"varlen": ReferenceVarlen, "dense_batched": DenseBatched(ReferenceDense)}


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", list(LAYOUTS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_merge_and_split_backward_equal_dense_attention(heads, case, kernel):
    hq, hkv = heads
    layout = prompts_first_row(*LAYOUTS[case])
    segment_ids, parent_ids = _ids(layout)
    t, d, scale = layout.num_tokens, 8, 8**-0.5
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, d, generator=gen, dtype=F64, requires_grad=True) for h in (hq, hkv, hkv))
    upstream = torch.randn(t, hq, d, generator=gen, dtype=F64)

    out = cascade_attention(q, k, v, cascade_plan(segment_ids, parent_ids), scale, kernel=KERNELS[kernel])
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref = dense_attention(q, k, v, segment_ids, parent_ids, scale)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)

    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-11, rtol=0, msg=f"d{name}")


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("case", ["ragged", "equal_lengths", "one_token_segments"])
def test_sinks_merge_exactly_with_their_gradient(case, kernel):
    layout = prompts_first_row(*LAYOUTS[case])
    segment_ids, parent_ids = _ids(layout)
    t, d, scale = layout.num_tokens, 8, 8**-0.5
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, h, d, generator=gen, dtype=F64, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, dtype=F64, requires_grad=True)
    upstream = torch.randn(t, 4, d, generator=gen, dtype=F64)
    out = cascade_attention(q, k, v, cascade_plan(segment_ids, parent_ids), scale, KERNELS[kernel], sinks)
    grads = torch.autograd.grad(out, (q, k, v, sinks), upstream)
    ref = dense_attention(q, k, v, segment_ids, parent_ids, scale, sinks)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), upstream)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for name, g, r in zip(["dq", "dk", "dv", "dsinks"], grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-11, rtol=0, msg=name)


def test_packed_mask_carries_its_plan_as_a_4d_tensor():
    from arctic_rl.zorro.features import AttentionFeatures
    from arctic_rl.zorro.packed_mask import PackedMask

    layout = prompts_first_row([[1, 2], [1, 2]], [1, 2])
    plan = cascade_plan(*_ids(layout))
    mask = PackedMask.of(layout, "flash", (AttentionFeatures(),), "qwen3", plan)
    assert mask.dim() == 4 and mask.plan is plan and mask.kernel == "flash"
    with pytest.raises(ValueError, match="needs cascade plan"):
        PackedMask.of(layout, "cudnn", (AttentionFeatures(),), "qwen3")


def test_unknown_kernel_name():
    layout = prompts_first_row([[1, 2]], [1])
    x = torch.zeros(3, 1, 8)
    with pytest.raises(ValueError, match="cascade kernel"):
        cascade_attention(x, x, x, cascade_plan(*_ids(layout)), 1.0, kernel="xformers")


def test_dense_batches_views_padding_and_key_lengths():
    # own part (causal): three back-to-back 100s form one zero-copy batch; 20 and 10 are not within
    # half of a longer batch's longest, so each runs alone, unpadded
    own = VarlenPart.of([0, 100, 200, 300, 320, 330], [0, 100, 200, 300, 320, 330], torch.device("cpu"))
    batches = dense_batches(own, True, torch.device("cpu"))
    assert [(b.n, b.q_len, b.k_len, b.view) for b in batches] == [(3, 100, 100, (0, 0)), (1, 20, 20, (300, 300)), (1, 10, 10, (320, 320))]
    assert dense_batches(own, True, torch.device("cpu")) is batches  # cached on the part
    # 60 and 40 share a padded batch (causal: right padding is never seen by a real query)
    own = VarlenPart.of([0, 60, 100], [0, 60, 100], torch.device("cpu"))
    (batch,) = dense_batches(own, True, torch.device("cpu"))
    assert (batch.n, batch.q_len, batch.view) == (2, DENSE_PAD, None)
    assert batch.q_src.tolist() == list(range(100))
    assert batch.q_dst.tolist() == list(range(60)) + list(range(DENSE_PAD, DENSE_PAD + 40))
    # cross part (not causal): groups batch only with equal key (prompt) lengths; queries padded
    cross = VarlenPart.of([0, 50, 80, 90], [0, 100, 200, 230], torch.device("cpu"))
    first, second = dense_batches(cross, False, torch.device("cpu"))
    assert (first.n, first.q_len, first.k_len, first.view) == (2, DENSE_PAD, 100, None)
    assert first.k_src.tolist() == first.k_dst.tolist() == list(range(200))
    assert first.q_dst.tolist() == list(range(50)) + list(range(DENSE_PAD, DENSE_PAD + 30))
    assert (second.n, second.q_len, second.k_len, second.view) == (1, 10, 30, (80, 200))
    # a 1-token segment (or a 1-token group over a 1-token prompt) is padded: cuDNN refuses 1 x 1
    (single,) = dense_batches(VarlenPart.of([0, 1], [0, 1], torch.device("cpu")), True, torch.device("cpu"))
    assert (single.q_len, single.k_len, single.view) == (DENSE_PAD, DENSE_PAD, None)
    (single,) = dense_batches(VarlenPart.of([0, 1], [0, 1], torch.device("cpu")), False, torch.device("cpu"))
    assert (single.q_len, single.k_len, single.view) == (DENSE_PAD, 1, None)


def test_many_distinct_cudnn_shapes_warn_once(caplog):
    shapes = GraphShapes(warn_at=3)
    q = torch.zeros(1, 2, 8, 4)
    with caplog.at_level("WARNING", logger="arctic_rl.zorro.cascade"):
        for _ in range(5):
            shapes.note(q, q, causal=True)  # one shape, seen again and again
        assert not caplog.records
        for length in (16, 24, 32, 40):
            shapes.note(torch.zeros(1, 2, length, 4), q, causal=False)
    assert len(shapes.seen) == 5
    assert len(caplog.records) == 1 and "met 3 distinct attention shapes" in caplog.records[0].getMessage()


class RoundingVarlen:
    """``ReferenceVarlen`` computed in float64 and returned as a fused bf16 kernel returns it: ``out`` in
    the inputs' dtype (rounded once), ``lse`` in fp32."""

    @staticmethod
    def forward(q, k, v, part, causal, scale):
        out, lse, _ = ReferenceVarlen.forward(q.double(), k.double(), v.double(), part, causal, scale)
        return out.to(q.dtype), lse.float(), None


@pytest.mark.parametrize("case", ["ragged", "equal_prompts_ragged_responses"])
def test_bf16_merge_rounds_once(case):
    """The merge of two bf16 partial results runs in fp32: the merged output's mean error against exact
    float64 attention stays within 1.35x the error of rounding the exact result to bf16 (a bf16 lerp with
    a bf16 weight measured 1.56x on the ragged case)."""
    layout = prompts_first_row(*LAYOUTS[case])
    segment_ids, parent_ids = _ids(layout)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(layout.num_tokens, h, 64, generator=gen).bfloat16() for h in (4, 2, 2))
    with torch.no_grad():
        out = cascade_attention(q, k, v, cascade_plan(segment_ids, parent_ids), 64**-0.5, kernel=RoundingVarlen)
        exact = dense_attention(q.double(), k.double(), v.double(), segment_ids, parent_ids, 64**-0.5)
    assert out.dtype == torch.bfloat16
    error = (out.double() - exact).abs().mean().item()
    rounding = (exact.bfloat16().double() - exact).abs().mean().item()
    assert error <= 1.35 * rounding, (error, rounding)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_selective_checkpointing_keeps_the_merged_output_and_runs_no_kernel_twice(kernel):
    """Under ``gradient_checkpointing: selective`` the cascade's replay takes the forward's output and lse from the tape
    (arctic_rl/checkpointing.py) instead of running its kernels again; the gradients are those without checkpointing,
    exactly. ``full`` runs both parts' kernels again."""
    from torch.utils.checkpoint import checkpoint

    from arctic_rl.checkpointing import selective_contexts

    layout = prompts_first_row(*LAYOUTS["ragged"])
    plan, t = cascade_plan(*_ids(layout)), layout.num_tokens
    calls = []

    class Counted:
        @staticmethod
        def forward(*args):
            calls.append(1)
            return KERNELS[kernel].forward(*args)

        backward = staticmethod(KERNELS[kernel].backward)

    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(t, h, 8, generator=gen, dtype=F64) for h in (4, 2, 2)]
    upstream = torch.randn(t, 4, 8, generator=gen, dtype=F64)

    def layer(q, k, v):  # a projection before and after, as in a decoder layer
        return cascade_attention(q * 2, k * 2, v * 2, plan, 8**-0.5, kernel=Counted).sin()

    results = {}
    for mode in ("off", "full", "selective"):
        q, k, v = (x.clone().requires_grad_() for x in inputs)
        calls.clear()
        if mode == "off":
            out = layer(q, k, v)
        else:
            out = checkpoint(layer, q, k, v, use_reentrant=False,
                             **({"context_fn": selective_contexts} if mode == "selective" else {}))
        results[mode] = (out.detach(), torch.autograd.grad(out, (q, k, v), upstream), len(calls))
    out, grads, forwards = results["off"]
    assert forwards == 2  # own and cross parts
    assert results["full"][2] == 2 * forwards and results["selective"][2] == forwards
    for mode in ("full", "selective"):
        assert torch.equal(results[mode][0], out)
        for g, r in zip(results[mode][1], grads):
            assert torch.equal(g, r), mode
