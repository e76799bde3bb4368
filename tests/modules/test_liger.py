"""``model.compute.liger`` on CPU: ``auto`` is off, ``true`` is an early error naming the field, and which modules of
Qwen3 / Llama / Qwen3-MoE (and which not, elsewhere) get Liger's kernels, with their names and weights unchanged.

Liger's Triton kernels do not run on CPU, so the wiring is checked with ``TorchReferenceLigerOps``: a fake of
liger-kernel (not ours) computing, in plain torch, what its kernels compute. In fp32 that equals the modules'
own code bit for bit, so log-probs and gradients of the patched model must equal the untouched twin's on the
naive path and on ZoRRo, with gradient checkpointing. The real kernels are compared in ``tests/zorro/test_gpu_liger.py``."""

import re

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.liger import LigerOps, LigerPlan, apply_liger, has_liger, plan_liger, resolve_liger
from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs
from tests.helpers import quickstart_config, write_config
from tests.zorro.models import build_tiny, make_batch, twin

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class TorchReferenceLigerOps:
    """Fake of liger-kernel's functional kernels: their semantics in torch, counting calls, on any device."""

    def __init__(self):
        self.calls = {"rms_norm": 0, "swiglu": 0, "rope": 0}

    def ops(self) -> LigerOps:
        return LigerOps(rms_norm=self.rms_norm, swiglu=self.swiglu, rope=self.rope, runs_on=lambda x: True)

    def rms_norm(self, x, weight, eps):  # casting_mode="llama", offset 0: normalise in fp32, scale in x's dtype
        self.calls["rms_norm"] += 1
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def swiglu(self, gate, up):
        self.calls["swiglu"] += 1
        return torch.nn.functional.silu(gate) * up

    def rope(self, q, k, cos, sin):
        self.calls["rope"] += 1
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _layers(*names: str) -> tuple[str, ...]:
    return tuple(f"model.layers.{i}.{n}" for i in range(2) for n in names)


EXPECTED = {  # the tiny models of tests/zorro/models.py: 2 layers
    "qwen3": LigerPlan(
        rms_norm=_layers("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")
        + ("model.norm",),
        swiglu=_layers("mlp"), rope=_layers("self_attn")),
    "llama": LigerPlan(rms_norm=_layers("input_layernorm", "post_attention_layernorm") + ("model.norm",),
                       swiglu=_layers("mlp"), rope=_layers("self_attn")),
    # every layer sparse (decoder_sparse_step 1): the experts keep transformers' own code, no dense MLP to swap
    "qwen3_moe": LigerPlan(
        rms_norm=_layers("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm")
        + ("model.norm",),
        swiglu=(), rope=_layers("self_attn")),
    # OLMo2 scales in fp32 before casting and rotates in its own code; Gemma2 norms by (1 + w), its MLP is GELU
    "olmo2": LigerPlan(rms_norm=(), swiglu=_layers("mlp"), rope=()),
    "gemma2": LigerPlan(rms_norm=(), swiglu=(), rope=_layers("self_attn")),
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_plan_names_exactly_the_modules_liger_reproduces(kind):
    plan = plan_liger(build_tiny(kind))
    assert sorted(plan.rms_norm) == sorted(EXPECTED[kind].rms_norm)
    assert (plan.swiglu, plan.rope) == (EXPECTED[kind].swiglu, EXPECTED[kind].rope)


def _run(fn, model, batch, **kw):
    prompts, ids, mask = batch
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, prompts, ids, mask, 0.8, True, 0, **kw)
    g = torch.Generator().manual_seed(3)
    ((torch.randn(lp.shape, generator=g) * lp).sum() + (torch.randn(ent.shape, generator=g) * ent).sum()).backward()
    return [lp.detach(), ent.detach()] + [p.grad for _, p in model.named_parameters()]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_patched_model_equals_its_twin_on_every_path(kind):
    """Same names and weights; log-probs and every gradient equal bit for bit (fp32), naive and ZoRRo,
    gradient checkpointing on; an unpatched model run afterwards never reaches the kernels."""
    batch = make_batch([9, 5], [0, 0, 1, 1], [4, 6, 3, 5])
    model = build_tiny(kind)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = twin(model)
    fake = TorchReferenceLigerOps()
    apply_liger(model, fake.ops())
    plan = EXPECTED[kind]
    assert sum(has_liger(m) for m in model.modules()) == len(plan.rms_norm + plan.swiglu + plan.rope)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    for fn, kw in ((response_logprobs, {}), (zorro_response_logprobs, {"attention_backend": "sdpa"})):
        expected = _run(fn, reference, batch, **kw)
        fake.calls = dict.fromkeys(fake.calls, 0)
        got = _run(fn, model, batch, **kw)
        assert all(v > 0 for v in fake.calls.values()), fake.calls  # forward and recompute went through the kernels
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), fn.__name__
        before = dict(fake.calls)
        _run(fn, reference, batch, **kw)
        assert fake.calls == before


def test_a_copy_of_a_patched_model_keeps_the_kernels():
    fake = TorchReferenceLigerOps()
    model = build_tiny("qwen3")
    apply_liger(model, fake.ops())
    copied = twin(model)
    batch = make_batch([7], [0, 0], [3, 4])
    fake.calls = dict.fromkeys(fake.calls, 0)
    with torch.no_grad():
        zorro_response_logprobs(copied, *batch, 1.0, False, 0, attention_backend="sdpa")
    passes = fake.calls["swiglu"] // 2  # head_spec's probe forwards and the packed one: 9 norms, 2 MLPs, 2 RoPEs each
    assert passes > 0 and fake.calls == {"rms_norm": 9 * passes, "swiglu": 2 * passes, "rope": 2 * passes}
    assert copied.model.norm.forward.__self__ is copied.model.norm


@cpu_only
def test_auto_is_off_and_true_is_an_error_without_cuda():
    assert resolve_liger("auto") is False and resolve_liger(False) is False
    with pytest.raises(ConfigError, match=r"model.compute.liger: true runs Liger's Triton kernels, which need a CUDA device"):
        resolve_liger(True)
    with pytest.raises(ConfigError, match=r"model.compute.liger must be auto, true or false, got 'on'"):
        resolve_liger("on")


@cpu_only
def test_module_with_liger_auto_keeps_its_own_code_on_cpu(toy_task):
    from arctic_rl.modules.grpo import GRPOModule
    from arctic_rl.modules.losses import Regularizers
    from arctic_rl.modules.options import ComputeOptions, SamplingOptions
    from arctic_rl.tasks.toy import tiny_qwen3_config

    module = GRPOModule(model=tiny_qwen3_config(33), tokenizer=str(toy_task / "tokenizer"), compute=ComputeOptions(liger="auto"),
                        regularizers=Regularizers(kl_coef=0.1), sampling=SamplingOptions(max_prompt_length=32, max_response_length=8))
    module.configure_model()
    for m in (module.model, module.ref_model):
        assert not any(has_liger(sub) or "forward" in vars(sub) for sub in m.modules())


@cpu_only
def test_cli_liger_true_without_cuda_is_one_line_naming_the_field(tmp_path, toy_task, capsys):
    from arctic_rl.cli import main

    config = write_config(quickstart_config(toy_task, tmp_path, **{"model.init_args.compute.liger": True}), tmp_path / "c.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"model.compute.liger: true .* need a CUDA device", errors[0]), errors
    assert not (tmp_path / "checkpoints").exists()
