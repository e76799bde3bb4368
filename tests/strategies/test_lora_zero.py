"""LoRA under DeepSpeed ZeRO-1 and ZeRO-2 (ArcticStrategy, 1 process over gloo on CPU; see conftest.lora_zero_runs).

- the checkpoint holds the adapters only: DeepSpeed's module state is exactly the 28 adapter tensors (A and B of 7
  linear layers x 2 decoder layers), no base or reference weight (the tied head included), no frozen fragments,
  and ZeRO's fp32 optimizer partition holds exactly the adapters' elements;
- a resume from it restores the adapters bit for bit (and the base, rebuilt from ``model.model``, is the initial
  one), then reproduces the uninterrupted run's step-3 loss (``rel=1e-5``, as test_arctic_strategy.py) and weights.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from arctic_rl.modules.lora import BASE_LAYER, is_adapter

pytestmark = pytest.mark.slow
ADAPTERS = 28


def base_name(name: str) -> str:
    """The saved model's name of a base tensor of the adapted policy (the tied head is the embedding)."""
    name = name.replace(BASE_LAYER, "")
    return "model.embed_tokens.weight" if name == "lm_head.weight" else name


def checkpoint_files(run, name: str):
    directory = (run.out / "checkpoints" / name).resolve() / "checkpoint"
    model = torch.load(directory / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    optim = torch.load(directory / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu", weights_only=False)
    return model, optim


def test_zero_lora_checkpoint_holds_the_adapters_only(lora_zero_runs):
    model, optim = checkpoint_files(lora_zero_runs["full"], "epoch=0-step=2.ckpt")
    keys = sorted(model["module"])
    assert len(keys) == ADAPTERS and all(is_adapter(k) for k in keys), keys
    assert all(k.startswith("model.model.layers.") for k in keys), keys  # the policy's; nothing of ref_model
    assert model.get("frozen_param_fragments") is None and model.get("frozen_param_shapes") is None
    adapter_numel = sum(t.numel() for t in model["module"].values())
    fp32 = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    assert sum(t.numel() for t in fp32) == adapter_numel  # ZeRO's master weights: the adapters, nothing frozen
    assert model["global_step"] == 2


def test_zero_lora_resume_restores_the_adapters_exactly_and_continues(lora_zero_runs, tiny_model_dir):
    full, resumed = lora_zero_runs["full"], lora_zero_runs["resumed"]
    saved, _ = checkpoint_files(full, "epoch=0-step=2.ckpt")
    start = torch.load(resumed.out / "model_state_start.pt", weights_only=True)
    initial = load_file(tiny_model_dir / "model.safetensors")
    for name, value in start.items():
        if is_adapter(name):
            assert torch.equal(value, saved["module"][f"model.{name}"]), name
        else:  # the base: rebuilt from model.model, the initial weights
            assert torch.equal(value, initial[base_name(name)]), name
    assert sum(is_adapter(n) for n in start) == ADAPTERS
    assert any(not torch.equal(v, torch.zeros_like(v)) for n, v in start.items() if "lora_B" in n)  # trained, not fresh

    (step3,) = [r for r in full.metrics() if r["step"] == 3]
    assert [r["step"] for r in resumed.metrics()] == [3]
    assert resumed.metrics()[0]["loss"] == pytest.approx(step3["loss"], rel=1e-5, abs=1e-7)
    end_full = torch.load(full.out / "model_state_end.pt", weights_only=True)
    end_resumed = torch.load(resumed.out / "model_state_end.pt", weights_only=True)
    assert end_full.keys() == end_resumed.keys()
    for name, value in end_resumed.items():
        torch.testing.assert_close(value, end_full[name], rtol=1e-5, atol=1e-6, msg=name)
        if not is_adapter(name):
            assert torch.equal(value, initial[base_name(name)]), f"base weight {name} changed"
