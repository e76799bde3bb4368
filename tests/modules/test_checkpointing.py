"""Selective activation checkpointing (``compute.gradient_checkpointing: selective``): the same gradients as no
checkpointing, bit for bit, and no linear layer's matmul run twice; ``full`` runs every matmul of the decoder layers
again.

The references are the model without checkpointing (exact: the kept matmul outputs are the forward's own tensors,
the replayed elementwise work is deterministic on CPU) and torch's full non-reentrant checkpointing."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from arctic_rl.errors import ConfigError
from arctic_rl.checkpointing import checkpointing_mode, enable_checkpointing
from arctic_rl.modules.models import response_logprobs
from arctic_rl.modules.options import ComputeOptions
from arctic_rl.zorro import zorro_response_logprobs
from tests.zorro.models import build_tiny, make_batch, twin

BATCH = ([5, 9], [0, 0, 0, 1, 1], [4, 1, 6, 3, 5])  # two shared prompts, ragged responses
LINEAR_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}  # attention's math path runs bmm


class OpCounter(TorchDispatchMode):
    """Counts the aten operators that run (forward and backward, replays included)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def step(model, zorro: bool, counter: OpCounter | None = None):
    """Log-probs, entropies and every gradient of one weighted loss, on float64 copies."""
    prompts, ids, mask = make_batch(*BATCH)
    run = zorro_response_logprobs if zorro else response_logprobs
    g = torch.Generator().manual_seed(1)
    with counter if counter is not None else torch.enable_grad():
        lp, ent = run(model, prompts, ids, mask, 0.7, True, 0)
        loss = (torch.randn(lp.shape, generator=g, dtype=lp.dtype) * lp).sum() + (
            torch.randn(ent.shape, generator=g, dtype=ent.dtype) * ent).sum()
        loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def copies(kind: str):
    model = build_tiny(kind, dtype=torch.float64)
    return {mode: twin(model) for mode in ("off", "full", "selective")}


@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "naive"])
@pytest.mark.parametrize("kind", ["qwen3", "gemma2"])  # gemma2: soft-capped, windowed attention
def test_selective_gives_exactly_the_gradients_of_no_checkpointing(kind, zorro):
    models = copies(kind)
    for mode, model in models.items():
        assert enable_checkpointing(model, {"off": False, "full": True, "selective": "selective"}[mode]) == mode
    results = {mode: step(model, zorro) for mode, model in models.items()}
    lp, ent, grads = results["off"]
    for mode in ("selective", "full"):
        other_lp, other_ent, other_grads = results[mode]
        assert torch.equal(other_lp, lp) and torch.equal(other_ent, ent), mode
        assert other_grads.keys() == grads.keys()
        for name, grad in grads.items():
            if mode == "selective":
                assert torch.equal(other_grads[name], grad), name
            else:  # full replays the matmuls in the same order too; allow the last bit
                torch.testing.assert_close(other_grads[name], grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "naive"])
def test_selective_runs_no_matmul_twice_and_full_runs_every_layer_matmul_again(zorro):
    models = copies("qwen3")
    counts = {}
    for mode, model in models.items():
        enable_checkpointing(model, {"off": False, "full": True, "selective": "selective"}[mode])
        counter = OpCounter()
        step(model, zorro, counter)
        counts[mode] = {op: n for op, n in counter.counts.items() if op in LINEAR_MATMULS}
    assert counts["off"], "the model runs matmuls"
    assert counts["selective"] == counts["off"]
    layer_matmuls = 2 * 6  # two layers' q, k, v, o, gate, up (torch's replay stops before down: nothing saves its output)
    assert sum(counts["full"].values()) - sum(counts["off"].values()) >= layer_matmuls


@pytest.mark.parametrize("value,mode", [(False, "off"), (None, "off"), (True, "full"), ("full", "full"),
                                        ("selective", "selective")])
def test_the_setting_names_a_mode(value, mode):
    assert checkpointing_mode(value) == mode


def test_an_unknown_setting_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.compute\.gradient_checkpointing .*'partial'"):
        ComputeOptions(gradient_checkpointing="partial")
    assert ComputeOptions(gradient_checkpointing="selective").gradient_checkpointing == "selective"


def test_selective_with_lora_adapters_gives_exactly_the_adapter_gradients_of_no_checkpointing():
    """LoRA (``apply_lora`` after checkpointing, as ``configure_model`` does): the frozen base layers' kept outputs
    need no weight gradient, the adapters' do; the same as without checkpointing."""
    pytest.importorskip("peft")
    from arctic_rl.modules.lora import LoraOptions, apply_lora

    models = copies("qwen3")
    results = {}
    for mode in ("off", "selective"):
        model = models[mode]
        enable_checkpointing(model, {"off": False, "selective": "selective"}[mode])
        torch.manual_seed(2)
        apply_lora(model, LoraOptions(rank=4, alpha=8))
        for name, p in model.named_parameters():  # lora_B starts at 0: give it values so the gradients are not trivial
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(3))
        results[mode] = step(model, zorro=True)
    (lp, ent, grads), (s_lp, s_ent, s_grads) = results["off"], results["selective"]
    assert torch.equal(s_lp, lp) and torch.equal(s_ent, ent)
    assert s_grads.keys() == grads.keys() and all("lora_" in name for name in grads) and len(grads) == 2 * 7 * 2
    for name, grad in grads.items():
        assert torch.equal(s_grads[name], grad), name
