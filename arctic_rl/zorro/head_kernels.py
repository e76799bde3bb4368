"""Fused Triton kernels for the head's vocabulary math (CUDA): ``log softmax(z)[target]`` of the
tempered logits ``z`` of head outputs ``u`` (``z = c tanh(u / d)`` with the model's soft-cap, else
``z = u / d``; ``head_spec.py``), the entropy, and their closed-form backward, each reading the
``[M, V]`` head outputs once.

The plain-torch path (``logprobs._LogprobFromLogits``) makes several fp32 passes over ``M x V``
(cast, log-sum-exp, and in backward cast, subtract, exp, scale, cast); with a 152k vocabulary those
passes cost as much as the head's matmul. Here one program per row streams the row in blocks:

* forward: an online log-sum-exp kept per lane (``m``, ``s``, and ``t = sum exp(z - m) z`` for the
  entropy), combined across lanes at the end; ``log p[target] = z[target] - log Z``,
  ``H = log Z - t / s``;
* backward: ``dz = p (-g_lp - g_ent (log p + H)) + g_lp onehot``, ``du = dz c (1 - tanh(u / d)^2) / d``
  (soft-cap) or ``dz / d``, written in the logits' dtype.

Same math and order of operations as the torch path, in fp32; ``tests/zorro/test_logprobs.py``
checks the two against each other (on CPU through Triton's interpreter when Triton is installed,
and on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
_MASKED = tl.constexpr(-1.0e30)  # finite stand-in for -inf past the vocabulary's end (exp gives 0, no NaN)


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice, so the interpreter runs it too); exact sign, no overflow."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _tempered(u, d, c, HAS_CAP: tl.constexpr):
    if HAS_CAP:
        return c * _tanh(u / d)
    return u / d


@triton.jit
def _forward_kernel(
    logits_ptr, stride_row, targets_ptr, logz_ptr, logp_ptr, entropy_ptr, vocab, d, c,
    HAS_CAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    lanes = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], _MASKED, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        inside = cols < vocab
        z = tl.where(inside, _tempered(tl.load(base + cols, mask=inside, other=0.0).to(tl.float32), d, c, HAS_CAP), _MASKED)
        new_m = tl.maximum(m, z)
        rescale = tl.exp(m - new_m)
        e = tl.exp(z - new_m)
        s = s * rescale + e
        if WITH_ENTROPY:
            t = t * rescale + e * z
        m = new_m
    row_max = tl.max(m, 0)
    weight = tl.exp(m - row_max)
    total = tl.sum(s * weight, 0)
    logz = row_max + tl.log(total)
    target = tl.load(targets_ptr + row)
    z_target = _tempered(tl.load(base + target).to(tl.float32), d, c, HAS_CAP)
    tl.store(logz_ptr + row, logz)
    tl.store(logp_ptr + row, z_target - logz)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, logz - tl.sum(t * weight, 0) / total)


@triton.jit
def _backward_kernel(
    logits_ptr, stride_row, targets_ptr, logz_ptr, entropy_ptr, grad_logp_ptr, grad_entropy_ptr, grad_ptr,
    stride_grad, vocab, d, c, HAS_CAP: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    out = grad_ptr + row * stride_grad
    logz = tl.load(logz_ptr + row)
    g_lp = tl.load(grad_logp_ptr + row)
    target = tl.load(targets_ptr + row)
    if WITH_ENTROPY:
        entropy = tl.load(entropy_ptr + row)
        g_ent = tl.load(grad_entropy_ptr + row)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + lanes
        inside = cols < vocab
        u = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_CAP:
            t = _tanh(u / d)
            log_p = c * t - logz
        else:
            log_p = u / d - logz
        p = tl.exp(log_p)
        if WITH_ENTROPY:
            grad = p * ((log_p + entropy) * -g_ent - g_lp)
        else:
            grad = p * -g_lp
        grad = tl.where(cols == target, grad + g_lp, grad)
        if HAS_CAP:
            grad = grad * (c * (1.0 - t * t))
        grad = grad / d
        tl.store(out + cols, grad.to(out.dtype.element_ty), mask=inside)


def fused_forward(logits: torch.Tensor, targets: torch.Tensor, d: float, c: float, with_entropy: bool):
    """``(logp, logz, entropy)`` fp32 ``[M]`` each (``entropy`` empty without ``with_entropy``);
    ``(d, c)`` from ``HeadTransform.kernel_params(T)``."""
    rows, vocab = logits.shape
    logz = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(logz)
    entropy = torch.empty_like(logz) if with_entropy else logz.new_empty(0)
    if rows:
        _forward_kernel[(rows,)](
            logits, logits.stride(0), targets, logz, logp, entropy if with_entropy else logz, vocab, d, c,
            HAS_CAP=c > 0, WITH_ENTROPY=with_entropy, BLOCK=BLOCK, num_warps=8,
        )
    return logp, logz, entropy


def fused_backward(logits, targets, logz, entropy, grad_logp, grad_entropy, d: float, c: float) -> torch.Tensor:
    """``dlogits`` in the logits' dtype; ``grad_entropy`` None when the entropy got no gradient."""
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)
    with_entropy = grad_entropy is not None
    if rows:
        _backward_kernel[(rows,)](
            logits, logits.stride(0), targets, logz, entropy if with_entropy else logz, grad_logp,
            grad_entropy.contiguous() if with_entropy else grad_logp, grad, grad.stride(0), vocab, d, c,
            HAS_CAP=c > 0, WITH_ENTROPY=with_entropy, BLOCK=BLOCK, num_warps=8,
        )
    return grad
