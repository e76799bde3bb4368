"""LoRA through peft (``modules/lora.py``): the options' checks, and exactness on a tiny random Qwen3 on CPU.

With adapters injected (``lora_B`` made non-zero, so they matter), one training step's loss and adapter gradients
(``TrainingCore.backward_batch``) are the same with ZoRRo and with the naive path, and the log-probs and
gradients of both equal each sequence run alone through the ``peft.PeftModel``'s own forward (an independent
copy wrapped by ``get_peft_model``). Tolerance: 1e-10 in float64 (RMSNorm in float64, as in
``tests/zorro/test_prefix_tree.py``), 1e-5 in float32. The merged weights the engines receive equal peft's own
merge. The base weights never get a gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.lora import LoraOptions, adapter_only, apply_lora, merged_named_tensors
from arctic_rl.modules.losses import LossNormalizer
from arctic_rl.modules.models import named_parameters_with_tied_head
from tests.zorro.models import build_tiny, make_batch
from tests.zorro.test_prefix_tree import rms_norm_in_input_dtype
from tests.zorro.test_prefix_tree_step import Core, rollout_of

TEMPERATURE = 0.8  # Core's


@pytest.mark.parametrize("kwargs, message", [
    ({"rank": -1}, "model.lora.rank must be an integer >= 1"),
    ({"rank": True}, "model.lora.rank must be an integer >= 1"),
    ({"rank": 4, "alpha": 0}, "model.lora.alpha must be > 0"),
    ({"rank": 4, "target_modules": []}, "model.lora.target_modules must be a non-empty list"),
    ({"rank": 4, "target_modules": "q_proj"}, "model.lora.target_modules must be a non-empty list"),
    ({"alpha": 8.0}, "model.lora.rank must be >= 1 where model.lora.alpha"),
])
def test_bad_options_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LoraOptions(**kwargs)


def test_unknown_target_modules_are_refused_before_any_model_is_built(tokenizer, toy_task):
    from arctic_rl.modules.grpo import GRPOModule
    from arctic_rl.tasks.toy import tiny_qwen3_config

    with pytest.raises(ConfigError, match=r"model.lora.target_modules: \['qkv_proj'\] name no linear layer.*q_proj, k_proj"):
        GRPOModule(model=tiny_qwen3_config(len(tokenizer)), tokenizer=str(toy_task / "tokenizer"),
                   sampling={"max_prompt_length": 16, "max_response_length": 16}, lora={"rank": 4, "target_modules": ["qkv_proj"]})


def test_lm_head_is_not_a_target():
    model = build_tiny("qwen3")
    with pytest.raises(ConfigError, match="lm_head"):
        apply_lora(model, LoraOptions(rank=2, target_modules=["lm_head"]))


def adapted(dtype, rank=4, targets=None):
    """A tiny Qwen3 with adapters whose ``lora_B`` is random (peft starts it at zero)."""
    model = build_tiny("qwen3", dtype=dtype)
    apply_lora(model, LoraOptions(rank=rank, alpha=2.0 * rank, target_modules=targets))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return model


def trainable(model):
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def test_only_adapters_train_and_the_adapter_starts_as_the_base():
    base = build_tiny("qwen3")
    model = apply_lora(copy.deepcopy(base), LoraOptions(rank=4))
    names = list(trainable(model))
    assert names and all(".lora_A.default." in n or ".lora_B.default." in n for n in names)
    assert len(names) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)  # lora_B is zero


def peft_reference(model, prompts, ids, mask, dtype):
    """Each sequence alone through ``get_peft_model`` of an independent copy with the same adapter values:
    ``(logprobs [N, R], adapter grads of the summed weighted loss, with peft's parameter names mapped back)``."""
    from peft import LoraConfig, get_peft_model

    base = build_tiny("qwen3", dtype=dtype)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                                     "gate_proj", "up_proj", "down_proj"]))
    ours = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            p.copy_(ours[name.removeprefix("base_model.model.")])
    rows = []
    for i, prompt in enumerate(prompts):
        n = int(mask[i].sum())
        seq = torch.tensor([prompt + ids[i, :n].tolist()])
        logits = peft_model(input_ids=seq).logits[0, len(prompt) - 1: len(prompt) - 1 + n].to(dtype) / TEMPERATURE
        lp = torch.log_softmax(logits, -1).gather(-1, ids[i, :n, None])[:, 0]
        rows.append(torch.cat([lp, torch.zeros(ids.shape[1] - n, dtype=dtype)]))
    return torch.stack(rows), peft_model


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_logprobs_and_gradients_zorro_equal_naive_equal_peft(monkeypatch, dtype, tol):
    if dtype == torch.float64:
        from transformers.models.qwen3 import modeling_qwen3

        monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)
    prompts, ids, mask = make_batch([6, 4], [0, 0, 0, 1, 1, 1], [3, 5, 2, 4, 1, 3])
    rollout = rollout_of(prompts, ids, mask, group_size=3)
    rollout.response_mask = rollout.response_mask.to(dtype)
    results = {}
    for zorro in (True, False):
        model = adapted(dtype)
        core = Core(model, zorro=zorro, dedup="group")
        with torch.no_grad():
            logprobs = core.sequence_logprobs(model, rollout)[0]
        normalizer = LossNormalizer.of(core.loss_mask(rollout), rollout.response_ids.shape[1])
        loss, _ = core.backward_batch(rollout, normalizer)
        assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)  # the base stays frozen
        results[zorro] = (logprobs, loss, {n: p.grad.clone() for n, p in trainable(model).items()}, model)
    (lp_z, loss_z, grads_z, model), (lp_n, loss_n, grads_n, _) = results[True], results[False]
    torch.testing.assert_close(lp_z, lp_n, rtol=tol, atol=tol)
    assert abs(loss_z - loss_n) <= tol * (1 + abs(loss_n))
    assert grads_z.keys() == grads_n.keys() and len(grads_z) == 28
    for name, g in grads_n.items():
        torch.testing.assert_close(grads_z[name], g, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")

    reference, peft_model = peft_reference(model, prompts, ids, mask, dtype)
    torch.testing.assert_close(lp_z, reference, rtol=tol, atol=tol)
    # the same weighted sum of log-probs, backward through ZoRRo and through peft's forward
    w = torch.randn(ids.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(dtype) * mask.to(dtype)
    model.zero_grad()
    (w * Core(model, zorro=True, dedup="group").sequence_logprobs(model, rollout)[0]).sum().backward()
    (w * reference).sum().backward()
    for name, p in peft_model.named_parameters():
        if p.requires_grad:
            ours = dict(model.named_parameters())[name.removeprefix("base_model.model.")]
            torch.testing.assert_close(ours.grad, p.grad, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


def test_merged_weights_equal_peft_merge_and_the_model():
    model = adapted(torch.float64, targets=["q_proj", "down_proj"])
    merged = {name: t.clone() for name, t in merged_named_tensors(model, named_parameters_with_tied_head(model))}
    plain = build_tiny("qwen3", dtype=torch.float64)
    assert list(merged) == [name for name, _ in named_parameters_with_tied_head(plain)]  # the base model's names, in order
    reference = copy.deepcopy(model)
    for module in reference.modules():
        if hasattr(module, "merge") and hasattr(module, "lora_A"):
            module.merge()  # peft's own merge: W += scaling * B @ A
    params = dict(named_parameters_with_tied_head(reference))
    for name, tensor in merged.items():
        want = params.get(name.replace(".weight", ".base_layer.weight"), params.get(name))
        torch.testing.assert_close(tensor, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           dict(model.named_parameters())["model.layers.0.self_attn.q_proj.base_layer.weight"])
    plain.load_state_dict(merged, strict=False)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(plain(ids).logits, model(ids).logits, rtol=1e-10, atol=1e-10)


def test_adapter_only_keeps_the_adapters():
    model = adapted(torch.float32)
    state = adapter_only(model.state_dict())
    assert set(state) == set(trainable(model)) and len(state) == 28
