"""The head's vocabulary math with its hand-written backward (``token_logprobs_from_logits``)
against the plain formula under autograd, in float64: values and gradients to 1e-12; and the fused
Triton kernels against the torch path: on a GPU, or on the CPU through Triton's interpreter
(``./scripts/install.sh`` puts Triton in ``.venv/triton-interpret``, off the venv's import path)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arctic_rl.zorro.logprobs import token_logprobs_from_logits

F64 = torch.float64


def reference(logits, targets, temperature):
    z = logits / temperature
    logz = torch.logsumexp(z, -1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - logz
    return logp, logz - (torch.softmax(z, -1) * z).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_values_and_gradients_equal_the_plain_formula(temperature, with_entropy):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 101, generator=gen, dtype=F64) * 4).requires_grad_()
    targets = torch.randint(0, 101, (37,), generator=gen)
    targets[:3] = targets[3]  # repeated targets
    up_lp, up_ent = torch.randn(37, generator=gen, dtype=F64), torch.randn(37, generator=gen, dtype=F64)

    logp, ent = token_logprobs_from_logits(logits, targets, temperature, with_entropy)
    ref_lp, ref_ent = reference(logits, targets, temperature)
    torch.testing.assert_close(logp, ref_lp, atol=1e-12, rtol=0)
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
        (grad,) = torch.autograd.grad((logp * up_lp).sum() + (ent * up_ent).sum(), logits)
        (ref_grad,) = torch.autograd.grad((ref_lp * up_lp).sum() + (ref_ent * up_ent).sum(), logits)
    else:
        assert ent is None
        (grad,) = torch.autograd.grad((logp * up_lp).sum(), logits)
        (ref_grad,) = torch.autograd.grad((ref_lp * up_lp).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)


def test_entropy_only_gradient_and_untouched_input():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 9, generator=gen, dtype=F64, requires_grad=True)
    before = logits.detach().clone()
    targets = torch.tensor([0, 3, 8, 8, 1])
    _, ent = token_logprobs_from_logits(logits, targets, 1.0, True)
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    (ref,) = torch.autograd.grad(reference(logits, targets, 1.0)[1].sum(), logits)
    torch.testing.assert_close(grad, ref, atol=1e-12, rtol=0)
    assert torch.equal(logits.detach(), before)  # in-place work never touches the caller's logits


def test_bf16_logits_give_fp32_results_and_bf16_gradients():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 50, generator=gen) * 3).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (8,), generator=gen)
    logp, ent = token_logprobs_from_logits(logits, targets, 0.9, True)
    assert logp.dtype == ent.dtype == torch.float32
    ref_lp, ref_ent = reference(logits.detach().double(), targets, 0.9)
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-6, rtol=0)  # fp32 math on exact bf16 inputs
    (grad,) = torch.autograd.grad(logp.sum() + ent.sum(), logits)
    assert grad.dtype == torch.bfloat16


def _fused_device() -> str | None:
    """CUDA, or the CPU through Triton's interpreter (``TRITON_INTERPRET=1``), else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(_fused_device() is None, reason="needs Triton: a CUDA device, or TRITON_INTERPRET=1 on the CPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [5000, 100])  # several blocks with a partial last one; less than one block
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_fused_triton_kernels_equal_the_torch_path(dtype, vocab, temperature, with_entropy):
    device = _fused_device()
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, vocab, generator=gen) * 5).to(device=device, dtype=dtype)
    targets = torch.randint(0, vocab, (7,), generator=gen).to(device)
    targets[-1] = vocab - 1  # the last column
    up_lp, up_ent = (torch.randn(7, generator=gen).to(device) for _ in range(2))
    results = []
    for fused in (False, True):
        x = logits.clone().requires_grad_()
        logp, ent = token_logprobs_from_logits(x, targets, temperature, with_entropy, fused=fused)
        loss = (logp * up_lp).sum() + ((ent * up_ent).sum() if with_entropy else 0)
        (grad,) = torch.autograd.grad(loss, x)
        results.append((logp, ent, grad))
    (lp, ent, grad), (f_lp, f_ent, f_grad) = results
    assert f_grad.dtype == dtype
    torch.testing.assert_close(f_lp, lp, atol=2e-5, rtol=1e-6)  # fp32 math in both, summed in another order
    if with_entropy:
        torch.testing.assert_close(f_ent, ent, atol=2e-5, rtol=1e-6)
    # fp32: log Z and H differ in the last bits (another summation order); bf16: one rounding of the gradient
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(f_grad.float(), grad.float(), **tol)


INTERPRETER_SITE = Path(sys.prefix) / "triton-interpret"


def needs_interpreter(test):
    """Skip ``test`` where the kernels run directly (CUDA) or no Triton for the interpreter is installed."""
    test = pytest.mark.skipif(_fused_device() is not None, reason="the kernels run directly here")(test)
    missing = not (INTERPRETER_SITE / "triton").is_dir()
    return pytest.mark.skipif(missing, reason=f"no Triton in {INTERPRETER_SITE} (scripts/install.sh)")(test)


def run_interpreted(test_file: str, test_name: str) -> str:
    """Run one test in a child process that sees Triton and runs its kernels interpreted; its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(INTERPRETER_SITE), *sys.path])}
    test = f"{Path(test_file).resolve()}::{test_name}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", test], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc.stdout


@needs_interpreter
def test_fused_kernels_under_the_triton_interpreter_on_cpu():
    """The fused-kernel test above, in a child process that sees Triton and runs it interpreted."""
    out = run_interpreted(__file__, "test_fused_triton_kernels_equal_the_torch_path")
    assert "16 passed" in out, out[-2000:]


def test_gather_rows_sums_repeated_rows_in_index_order_on_cpu():
    """A prompt's last state feeds the first token of each of its G responses: its gradient is a sum
    whose float result depends on the order. ``gather_rows`` must add in index order, every time (plain
    ``hidden[index]`` adds with CPU atomics in no fixed order, which made identical runs differ)."""
    from arctic_rl.zorro.logprobs import gather_rows

    torch.manual_seed(0)
    index = torch.randint(0, 4, (4096,))  # ~1000 repeats of each of 4 rows
    upstream = torch.randn(4096, 8) * torch.logspace(-6, 6, 4096)[:, None]  # magnitudes where order matters
    hidden = torch.zeros(4, 8, requires_grad=True)
    gather_rows(hidden, index).backward(upstream)
    expected = torch.zeros(4, 8)
    for i, row in zip(index.tolist(), upstream):  # the sum in index order, one add at a time
        expected[i] += row
    assert torch.equal(hidden.grad, expected)
    reversed_order = torch.zeros(4, 8)
    for i, row in zip(reversed(index.tolist()), upstream.flip(0)):
        reversed_order[i] += row
    assert not torch.equal(expected, reversed_order)  # the order is visible in the bits: the check has teeth
