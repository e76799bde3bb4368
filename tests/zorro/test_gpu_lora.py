"""GPU: LoRA adapters (``modules/lora.py``, peft) under ZoRRo on every attention backend, bf16, against the naive path.

As in ``test_gpu.py``, bf16 cannot match bit for bit: the reference is the naive path in fp32 on the same adapted
weights, and ZoRRo's bf16 relative error (log-probs, entropies, every adapter gradient) must stay within 2x the
naive bf16 run's own error plus 2e-3; in fp32, flex must match the reference to 1e-3. ``lora_B`` is made non-zero so
the adapters change the forward. The base weights must get no gradient on any path."""

import pytest
import torch

from arctic_rl.modules.lora import LoraOptions, apply_lora
from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs

from .models import CONFIGS, build_tiny, make_batch, twin
from .test_gpu import GPU_CASES, GPU_SIZES, rel_errors, run

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_sized_configs(monkeypatch):
    for kind in CONFIGS:
        monkeypatch.setitem(CONFIGS, kind, {**CONFIGS[kind], **GPU_SIZES})


def adapted(kind: str) -> torch.nn.Module:
    """An fp32 model on the GPU with rank-8 adapters on every decoder linear layer, ``lora_B`` random."""
    model = build_tiny(kind, device="cuda")
    apply_lora(model, LoraOptions(rank=8, alpha=16.0))
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g, device="cuda"))
    return model


def adapter_parts(model, values):
    """(names, values) of the adapter gradients among ``run``'s outputs (log-probs, entropies, then every parameter)."""
    names = ["logprobs", "entropy"] + [n for n, _ in model.named_parameters()]
    keep = [i for i, n in enumerate(names) if i < 2 or "lora_" in n]
    return [names[i] for i in keep], [values[i] for i in keep]


@pytest.mark.parametrize("backend", ["flex", "cudnn", "flash_varlen"])
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_lora_bf16_zorro_within_the_naive_paths_error(kind, backend):
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = adapted(kind)
    ref = run(response_logprobs, ref_model, batch)
    naive_model, zorro_model = twin(ref_model).to(torch.bfloat16), twin(ref_model).to(torch.bfloat16)
    naive = rel_errors(run(response_logprobs, naive_model, batch), ref)
    zorro = rel_errors(run(zorro_response_logprobs, zorro_model, batch, attention_backend=backend), ref)
    assert all(p.grad is None for n, p in zorro_model.named_parameters() if "lora_" not in n)  # the base is frozen
    names, pairs = adapter_parts(ref_model, list(zip(zorro, naive)))
    assert len(names) > 2
    bad = [(n, z, e) for n, (z, e) in zip(names, pairs) if z > 2 * e + 2e-3]
    assert not bad, f"zorro bf16 error above 2x naive bf16 error: {bad}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_lora_flex_fp32_matches_the_reference(kind):
    batch = make_batch(*GPU_CASES["shared_varied"], device="cuda")
    ref_model = adapted(kind)
    ref = run(response_logprobs, ref_model, batch)
    errors = rel_errors(run(zorro_response_logprobs, twin(ref_model), batch, attention_backend="flex"), ref)
    names, values = adapter_parts(ref_model, errors)
    assert max(values) < 1e-3, list(zip(names, values))
