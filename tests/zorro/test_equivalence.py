"""ZoRRo log-probs, entropies and every parameter's gradient equal the naive per-sequence
computation (``arctic_rl.modules.models.response_logprobs``), fp32 on CPU.

Tolerance: absolute 2e-5 on log-probs / entropies, absolute 2e-5 + relative 1e-4 on gradients
(observed differences are ~1e-6: packed vs. padded attention sums in a different order)."""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import ZorroUnsupportedModel, dedup_stats, zorro_response_logprobs

from .models import build_tiny, make_batch, twin

ATOL, RTOL = 2e-5, 1e-4
CASES = {  # prompt lengths, prompt of each sample, response lengths
    "shared_prompts_of_different_lengths": ([5, 9], [0, 0, 0, 1, 1], [4, 1, 6, 3, 5]),
    "group_of_one": ([3, 7], [0, 1, 1, 1], [5, 2, 4, 4]),
    "no_sharing": ([4, 6, 2, 5], [0, 1, 2, 3], [3, 5, 2, 1]),
    "interleaved_and_empty_responses": ([6, 4, 3], [0, 1, 0, 1, 2, 2], [3, 0, 5, 2, 0, 0]),
}


def weighted_loss(logprobs, entropy, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logprobs.shape, generator=g)
    loss = (w * logprobs).sum()
    return loss if entropy is None else loss + (torch.randn(entropy.shape, generator=g) * entropy).sum()


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_naive(model, prompts, ids, mask, temperature=0.7, with_entropy=True):
    lp, ent = response_logprobs(model, prompts, ids, mask, temperature, with_entropy, pad_token_id=0)
    weighted_loss(lp, ent).backward()
    return lp.detach(), None if ent is None else ent.detach(), grads(model)


def run_zorro(model, prompts, ids, mask, micro_batch=None, temperature=0.7, with_entropy=True):
    """ZoRRo over consecutive micro-batches of ``micro_batch`` samples (groups may straddle)."""
    step = micro_batch or len(prompts)
    lps, ents = [], []
    for s in range(0, len(prompts), step):
        lp, ent = zorro_response_logprobs(
            model, prompts[s : s + step], ids[s : s + step], mask[s : s + step], temperature, with_entropy,
            pad_token_id=0, attention_backend="sdpa",
        )
        lps.append(lp)
        ents.append(ent)
    lp, ent = torch.cat(lps), torch.cat(ents) if with_entropy else None
    weighted_loss(lp, ent).backward()
    return lp.detach(), None if ent is None else ent.detach(), grads(model)


def assert_same(naive, zorro):
    torch.testing.assert_close(zorro[0], naive[0], atol=ATOL, rtol=0)
    if naive[1] is not None:
        torch.testing.assert_close(zorro[1], naive[1], atol=ATOL, rtol=0)
    assert naive[2].keys() == zorro[2].keys() and len(naive[2]) > 0
    for name, g in naive[2].items():
        torch.testing.assert_close(zorro[2][name], g, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive(kind, case):
    prompts, ids, mask = make_batch(*CASES[case])
    model = build_tiny(kind)
    zmodel = twin(model)
    assert_same(run_naive(model, prompts, ids, mask), run_zorro(zmodel, prompts, ids, mask))
    assert (ids.shape[1] > 0) and torch.all(run_zorro(twin(model), prompts, ids, mask)[0][mask == 0] == 0)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_group_size_not_dividing_micro_batch(kind):
    # G = 3, 9 samples in micro-batches of 4: groups straddle micro-batches (prompt computed in both)
    prompts, ids, mask = make_batch([5, 3, 8], [0, 0, 0, 1, 1, 1, 2, 2, 2], [2, 4, 3, 1, 5, 2, 3, 3, 4])
    model = build_tiny(kind)
    assert_same(run_naive(model, prompts, ids, mask), run_zorro(twin(model), prompts, ids, mask, micro_batch=4))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_gradient_checkpointing(kind, use_reentrant):
    prompts, ids, mask = make_batch(*CASES["shared_prompts_of_different_lengths"])
    model = build_tiny(kind)
    zmodel = twin(model)
    for m in (model, zmodel):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert_same(run_naive(model, prompts, ids, mask), run_zorro(zmodel, prompts, ids, mask))


def test_without_entropy_and_without_grad():
    prompts, ids, mask = make_batch(*CASES["group_of_one"])
    model = build_tiny("qwen3")
    zmodel = twin(model)
    assert_same(run_naive(model, prompts, ids, mask, with_entropy=False),
                run_zorro(zmodel, prompts, ids, mask, with_entropy=False))
    with torch.no_grad():
        lp, ent = zorro_response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)
        ref, _ = response_logprobs(model, prompts, ids, mask, 1.0, False, 0)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, ref, atol=ATOL, rtol=0)


def test_model_keeps_sdpa_semantics_for_ordinary_forwards():
    prompts, ids, mask = make_batch(*CASES["no_sharing"])
    model = build_tiny("llama")
    zmodel = twin(model)
    zorro_response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)  # switches zmodel to "zorro"
    assert zmodel.config._attn_implementation == "zorro"
    with torch.no_grad():  # a naive padded forward through the switched model is unchanged
        torch.testing.assert_close(response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)[0],
                                   response_logprobs(model, prompts, ids, mask, 1.0, False, 0)[0], atol=ATOL, rtol=0)


def test_all_responses_empty_gives_zeros():
    prompts, ids, mask = make_batch([3], [0, 0], [0, 0])
    lp, ent = zorro_response_logprobs(build_tiny("qwen3"), prompts, ids, mask, 1.0, True, 0)
    assert lp.shape == ent.shape == (2, 1) and not lp.any() and not ent.any()


def test_dedup_stats_of_a_case():
    prompts, _, mask = make_batch(*CASES["shared_prompts_of_different_lengths"])
    stats = dedup_stats(prompts, mask)
    assert (stats.naive_tokens, stats.processed_tokens) == (3 * 5 + 2 * 9 + 19, 5 + 9 + 19)


def test_unsupported_models_fail_loudly():
    from transformers import AutoConfig, AutoModelForCausalLM

    prompts, ids, mask = make_batch([3], [0], [2])
    chunked = build_tiny("qwen3")  # more refusals (windows without a known builder, ...) in test_features.py
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(ZorroUnsupportedModel, match="model type 'qwen3'.*chunked_attention"):
        zorro_response_logprobs(chunked, prompts, ids, mask, 1.0, False, 0)
    mamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mamba", vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2))
    with pytest.raises(ZorroUnsupportedModel, match="model type 'mamba'"):
        zorro_response_logprobs(mamba, prompts, ids, mask, 1.0, False, 0)


def test_bad_backend_name():
    prompts, ids, mask = make_batch([3], [0], [2])
    with pytest.raises(ValueError, match="attention_backend"):
        zorro_response_logprobs(build_tiny("qwen3"), prompts, ids, mask, 1.0, False, 0, attention_backend="xformers")


def test_generation_with_cache_is_unchanged_after_switch():
    prompts, ids, mask = make_batch(*CASES["no_sharing"])
    model = build_tiny("qwen3").eval()
    zmodel = twin(model)
    zorro_response_logprobs(zmodel, prompts, ids, mask, 1.0, False, 0)
    input_ids = torch.tensor([prompts[0]])
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(zmodel.generate(input_ids, **kwargs), model.generate(input_ids, **kwargs))


def test_prompts_first_row_gives_the_same_hidden_states():
    """The ``flash_varlen`` layout (all prompts first) is the same computation as the interleaved one."""
    from arctic_rl.zorro.logprobs import packed_hidden_states
    from arctic_rl.zorro.packing import pack_shared_prompts, response_lengths

    model = build_tiny("qwen3")
    prompts, ids, mask = make_batch(*CASES["interleaved_and_empty_responses"])
    out = []
    for prompts_first in (False, True):
        layout = pack_shared_prompts(prompts, ids, response_lengths(mask), prompts_first=prompts_first)
        with torch.no_grad():
            out.append(packed_hidden_states(model, layout, "sdpa")[layout.predictor_index])
    assert out[0].shape[0] == int(mask.sum())
    torch.testing.assert_close(out[1], out[0], atol=2e-6, rtol=0)


@pytest.mark.parametrize("backend", ["cudnn", "flash_varlen"])
def test_cascade_backends_need_cuda(backend):
    prompts, ids, mask = make_batch(*CASES["interleaved_and_empty_responses"])
    with pytest.raises(ValueError, match=f"'{backend}' runs fused CUDA attention kernels and needs CUDA"):
        zorro_response_logprobs(build_tiny("qwen3"), prompts, ids, mask, 1.0, False, 0, attention_backend=backend)
