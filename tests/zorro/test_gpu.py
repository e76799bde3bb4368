"""GPU: ZoRRo with FlexAttention and with cascade attention (on cuDNN in dense batches, and on FlashAttention-2 varlen), bf16, against the naive per-sequence SDPA computation.

bf16 results cannot match bit for bit, so both bf16 runs are compared with an fp32 reference
from the same weights: ZoRRo's relative error must stay within ``2x`` the naive bf16 path's own
error (plus a small floor). An fp32 run of the flex kernel must match the fp32 reference closely.
Lengths straddle the 128-token blocks so partial, full and skipped blocks all occur."""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs

from .models import CONFIGS, build_tiny, make_batch, twin

pytestmark = pytest.mark.gpu
GPU_SIZES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
GPU_CASES = {
    "shared_varied": ([150, 300], [0, 0, 0, 1, 1], [130, 7, 200, 64, 129]),
    "group_of_one_and_interleaved": ([40, 257], [0, 1, 1, 0, 1], [256, 1, 90, 0, 128]),
    "no_sharing": ([128, 5, 77], [0, 1, 2], [128, 300, 33]),
}


@pytest.fixture(autouse=True)
def gpu_sized_configs(monkeypatch):
    for kind in CONFIGS:
        monkeypatch.setitem(CONFIGS, kind, {**CONFIGS[kind], **GPU_SIZES})


def run(fn, model, batch, **kw):
    prompts, ids, mask = batch
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, prompts, ids, mask, 0.8, True, 0, **kw)
    g = torch.Generator(device="cuda").manual_seed(3)
    ((torch.randn(lp.shape, generator=g, device="cuda") * lp).sum() + (torch.randn(ent.shape, generator=g, device="cuda") * ent).sum()).backward()
    return [lp.detach().float(), ent.detach().float()] + [torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.float()
                                                   for _, p in model.named_parameters()]


def rel_errors(out, ref):
    return [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(out, ref)]


@pytest.mark.parametrize("backend", ["flex", "cudnn", "flash_varlen"])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_bf16_matches_naive_sdpa(kind, case, backend):
    batch = make_batch(*GPU_CASES[case], device="cuda")
    ref_model = build_tiny(kind, device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    naive = rel_errors(run(response_logprobs, twin(ref_model).to(torch.bfloat16), batch), ref)
    zorro = rel_errors(run(zorro_response_logprobs, twin(ref_model).to(torch.bfloat16), batch, attention_backend=backend), ref)
    names = ["logprobs", "entropy"] + [n for n, _ in ref_model.named_parameters()]
    bad = [(n, z, e) for n, z, e in zip(names, zorro, naive) if z > 2 * e + 2e-3]
    assert not bad, f"zorro bf16 error above 2x naive bf16 error: {bad}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_flex_fp32_matches_reference(kind):
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = build_tiny(kind, device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    errors = rel_errors(run(zorro_response_logprobs, twin(ref_model), batch, attention_backend="flex"), ref)
    assert max(errors) < 1e-3, errors


@pytest.mark.parametrize("backend", ["flex", "cudnn", "flash_varlen"])
def test_gradient_checkpointing_bf16(backend):
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = build_tiny("qwen3", device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    naive_model, zorro_model = twin(ref_model).to(torch.bfloat16), twin(ref_model).to(torch.bfloat16)
    for m in (naive_model, zorro_model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    naive = rel_errors(run(response_logprobs, naive_model, batch), ref)
    zorro = rel_errors(run(zorro_response_logprobs, zorro_model, batch, attention_backend=backend), ref)
    assert all(z <= 2 * e + 2e-3 for z, e in zip(zorro, naive)), list(zip(zorro, naive))


def test_flex_and_dense_reference_agree_bf16():
    batch = make_batch(*GPU_CASES["group_of_one_and_interleaved"], device="cuda")
    model = build_tiny("qwen3_moe", device="cuda", dtype=torch.bfloat16)
    flex = run(zorro_response_logprobs, twin(model), batch, attention_backend="flex")
    dense = run(zorro_response_logprobs, twin(model), batch, attention_backend="sdpa")
    assert max(rel_errors(flex[:2], dense[:2])) < 2e-2


@pytest.mark.parametrize("backend", ["cudnn", "flash_varlen"])
def test_cascade_backends_reject_fp32(backend):
    batch = make_batch(*GPU_CASES["no_sharing"], device="cuda")
    with pytest.raises(ValueError, match="bf16 or fp16"):
        run(zorro_response_logprobs, build_tiny("qwen3", device="cuda"), batch, attention_backend=backend)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_cascade_kernel_matches_dense_attention_bf16(kernel):
    """The attention op alone, GQA, lengths of 1 to 300 (cuDNN: padded and zero-copy batches),
    against fp32 dense masked attention."""
    from arctic_rl.zorro.cascade import cascade_attention, cascade_plan
    from arctic_rl.zorro.packing import pack_shared_prompts

    from .test_cascade import dense_attention

    prompts = [[1] * 37, [2] * 130, [1] * 37, [3], [2] * 130, [1] * 37, [4] * 130, [4] * 130, [4] * 130]
    lengths = [5, 64, 300, 7, 1, 40, 200, 200, 200]
    layout = pack_shared_prompts(prompts, torch.ones(9, 300, dtype=torch.long, device="cuda"), lengths, prompts_first=True)
    t, scale = layout.num_tokens, 128**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(t, h, 128, generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (16, 8, 8))
    up = torch.randn(t, 16, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = cascade_attention(q, k, v, cascade_plan(layout.segment_ids, layout.parent_ids), scale, kernel)
    grads = torch.autograd.grad(out, (q, k, v), up)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = dense_attention(q32, k32, v32, layout.segment_ids, layout.parent_ids, scale)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), up.float())
    for name, a, b in zip(["out", "dq", "dk", "dv"], (out, *grads), (ref, *ref_grads)):
        err = ((a.float() - b).norm() / b.norm()).item()
        assert err < 1e-2, (name, err)  # bf16 inputs and outputs against an fp32 reference


@pytest.mark.parametrize("backend", ["naive", "flex", "cudnn", "flash_varlen"])
def test_selective_checkpointing_bf16_gives_the_results_without_checkpointing(backend):
    """``gradient_checkpointing: selective`` on the GPU paths (kept linear outputs, replayed attention) equals the run
    without checkpointing in bf16: attention backward kernels may sum in another order, so to within a tenth of the
    naive path's own bf16 error against fp32. Full checkpointing is held to the same bound."""
    from arctic_rl.checkpointing import enable_checkpointing

    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = build_tiny("qwen3", device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    fn, kw = (response_logprobs, {}) if backend == "naive" else (zorro_response_logprobs, {"attention_backend": backend})
    results = {}
    for mode in (False, "selective", True):
        model = twin(ref_model).to(torch.bfloat16)
        enable_checkpointing(model, mode)
        results[mode] = run(fn, model, batch, **kw)
    naive_error = rel_errors(run(response_logprobs, twin(ref_model).to(torch.bfloat16), batch), ref)
    for mode in ("selective", True):
        diff = rel_errors(results[mode], results[False])
        assert all(d <= 0.1 * e + 1e-4 for d, e in zip(diff, naive_error)), (mode, list(zip(diff, naive_error)))
