"""The head transform's math (``head_spec.py``) inside the vocabulary head: the torch path against
plain autograd in float64 (values and gradients to 1e-12), and the fused Triton kernels with a
scale and a soft-cap against the torch path, on a GPU (bf16 included) or on the CPU through
Triton's interpreter in a child process (as ``test_logprobs.py`` does)."""


import pytest
import torch

from arctic_rl.zorro.head_spec import HeadTransform
from arctic_rl.zorro.logprobs import token_logprobs_from_logits

from .test_logprobs import _fused_device, needs_interpreter, run_interpreted

TRANSFORMS = {
    "granite_divide": HeadTransform(scale=0.25),
    "cohere_multiply": HeadTransform(scale=3.0),
    "gemma_softcap": HeadTransform(softcap=2.5),
    "glimmer_scale_then_cap": HeadTransform(scale=1.7, softcap=4.0),
}


def plain(logits, targets, temperature, transform):
    z = transform.model_logits(logits) / temperature
    log_probs = torch.log_softmax(z, -1)
    return log_probs.gather(-1, targets[:, None]).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_torch_path_equals_autograd_of_the_plain_formula(transform, temperature, with_entropy):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(23, 77, generator=gen, dtype=torch.float64) * 6).requires_grad_()
    targets = torch.randint(0, 77, (23,), generator=gen)
    w_lp, w_ent = torch.randn(23, generator=gen, dtype=torch.float64), torch.randn(23, generator=gen, dtype=torch.float64)
    logp, ent = token_logprobs_from_logits(logits, targets, temperature, with_entropy, transform=TRANSFORMS[transform])
    ref_lp, ref_ent = plain(logits, targets, temperature, TRANSFORMS[transform])
    torch.testing.assert_close(logp, ref_lp, atol=1e-12, rtol=0)
    loss, ref_loss = (logp * w_lp).sum(), (ref_lp * w_lp).sum()
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
        loss, ref_loss = loss + (ent * w_ent).sum(), ref_loss + (ref_ent * w_ent).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


@pytest.mark.skipif(_fused_device() is None, reason="needs Triton: a CUDA device, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5000, 100])  # several blocks with a partial last one; less than one block
@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_kernels_with_scale_and_cap_equal_the_torch_path(dtype, vocab, transform, with_entropy):
    device = _fused_device()
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, vocab, generator=gen) * 8).to(device=device, dtype=dtype)  # reaches the cap's flat range
    targets = torch.randint(0, vocab, (7,), generator=gen).to(device)
    targets[-1] = vocab - 1
    up_lp, up_ent = (torch.randn(7, generator=gen).to(device) for _ in range(2))
    results = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs_from_logits(x, targets, 0.7, with_entropy, fused=fused, transform=TRANSFORMS[transform])
        loss = (logp * up_lp).sum() + ((ent * up_ent).sum() if with_entropy else 0)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((logp, ent, grad))
    (lp, ent, grad), (f_lp, f_ent, f_grad) = results
    assert f_grad.dtype == dtype
    torch.testing.assert_close(f_lp, lp, atol=5e-5, rtol=1e-6)  # fp32 in both; tanh from exp in the kernel
    if with_entropy:
        torch.testing.assert_close(f_ent, ent, atol=5e-5, rtol=1e-6)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(f_grad.float(), grad.float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_fused_bf16_head_on_a_152k_vocabulary(transform):
    """GPU: a Qwen-sized vocabulary in bf16, fused against the torch path."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(64, 151_936, generator=gen, device="cuda") * 8).to(torch.bfloat16)
    targets = torch.randint(0, 151_936, (64,), generator=gen, device="cuda")
    out = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs_from_logits(x, targets, 0.9, True, fused=fused, transform=TRANSFORMS[transform])
        (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), x)
        out.append((logp, ent, grad))
    torch.testing.assert_close(out[1][0], out[0][0], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(out[1][2].float(), out[0][2].float(), atol=1e-3, rtol=1e-2)


@needs_interpreter
def test_fused_kernels_with_scale_and_cap_under_the_triton_interpreter_on_cpu():
    out = run_interpreted(__file__, "test_fused_kernels_with_scale_and_cap_equal_the_torch_path")
    assert "32 passed" in out, out[-2000:]
