"""Log-probs, entropies and every parameter gradient of both head paths (naive ``response_logprobs``
and ZoRRo) against the model's own per-sequence forward (``model(ids).logits``, log-softmax at the
temperature), for families whose head post-processes its logits (Granite and GraniteMoE divide by
``logits_scaling``, Gemma 2 and Gemma 3 text soft-cap with ``final_logit_softcapping``) and for plain
controls (Qwen3, Llama); fp32 and float64 on CPU.

The Gemma configs use full attention on every layer and no attention soft-cap: sliding windows and
attention caps in ZoRRo are tested with the attention backends; this file is about the head.
The output head's weights are scaled up so the logits reach the soft-cap's curved range.
"""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs
from arctic_rl.zorro.head_spec import HeadTransform, UnsupportedLogitTransform, head_transform

from .models import COMMON, VOCAB, make_batch, twin

FAMILIES = {
    "granite": dict(
        model_type="granite", intermediate_size=48, logits_scaling=4.0, embedding_multiplier=3.0,
        residual_multiplier=0.5, attention_multiplier=0.3, tie_word_embeddings=False, **COMMON,
    ),
    "granitemoe": dict(
        model_type="granitemoe", intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
        logits_scaling=0.5, tie_word_embeddings=False, **COMMON,
    ),
    "gemma2": dict(
        model_type="gemma2", intermediate_size=48, final_logit_softcapping=1.5, attn_logit_softcapping=None,
        layer_types=["full_attention"] * 2, query_pre_attn_scalar=8, **COMMON,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", intermediate_size=48, final_logit_softcapping=2.0,
        layer_types=["full_attention"] * 2, query_pre_attn_scalar=8, **COMMON,
    ),
    "minicpm3": dict(  # divides the hidden state by logits_scaling = hidden_size / dim_model_base before the head
        model_type="minicpm3", intermediate_size=48, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, dim_model_base=8, scale_emb=2, **{**COMMON, "num_key_value_heads": 4},
    ),
    "qwen3": dict(model_type="qwen3", intermediate_size=48, tie_word_embeddings=True, **COMMON),
    "llama": dict(model_type="llama", intermediate_size=48, tie_word_embeddings=False, **COMMON),
}
EXPECTED_HEAD = {
    "granite": HeadTransform(scale=0.25), "granitemoe": HeadTransform(scale=2.0),
    "gemma2": HeadTransform(softcap=1.5), "gemma3_text": HeadTransform(softcap=2.0),
    "minicpm3": HeadTransform(scale=0.25), "qwen3": HeadTransform(), "llama": HeadTransform(),
}
# several groups, interleaved samples, a group of one (prompt 2), an empty response
BATCH = ([5, 9, 3], [0, 1, 0, 2, 1, 0], [4, 2, 6, 3, 0, 1])
TEMPERATURE = 0.8
# values: float64 to 1e-10. Gradients: these families' RMSNorms compute in float32 even for float64
# weights, and ZoRRo sums a shared prompt's gradients in another order than G separate sequences,
# so float64 gradients agree to float32's rounding there (observed <= 5e-6 absolute), not to 1e-10
TOLERANCE = {torch.float32: (2e-5, dict(atol=2e-5, rtol=1e-4)), torch.float64: (1e-10, dict(atol=1e-5, rtol=1e-5))}


def build_family(kind: str, dtype: torch.dtype, seed: int = 0, **changes) -> torch.nn.Module:
    """A seeded tiny model of ``kind`` (sdpa attention, eager experts so float64 runs), head weights x8;
    ``changes`` override config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**FAMILIES[kind], **changes})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # torch's grouped_mm has no float64 kernel
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        model.get_output_embeddings().weight.mul_(8.0)
    return model.train()


def own_forward_logprobs(model, prompts, ids, mask, temperature):
    """Per sample, unpadded: ``log_softmax(model(prompt + response).logits / T)`` and the entropy."""
    acc = torch.promote_types(model.dtype, torch.float32)
    rows_lp, rows_ent = [], []
    for i, prompt in enumerate(prompts):
        n = int(mask[i].sum())
        seq = torch.tensor(prompt + ids[i, :n].tolist())[None]
        logits = model(input_ids=seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].to(acc) / temperature
        log_probs = torch.log_softmax(logits, -1)
        rows_lp.append(log_probs.gather(-1, ids[i, :n, None]).squeeze(-1))
        rows_ent.append(-(log_probs.exp() * log_probs).sum(-1))
    logps = torch.stack([torch.cat([lp, lp.new_zeros(ids.shape[1] - lp.shape[0])]) for lp in rows_lp])
    ents = torch.stack([torch.cat([e, e.new_zeros(ids.shape[1] - e.shape[0])]) for e in rows_ent])
    return logps, ents


def path_logprobs(path):
    def run(model, prompts, ids, mask, temperature):
        if path == "naive":
            return response_logprobs(model, prompts, ids, mask, temperature, True, pad_token_id=0)
        return zorro_response_logprobs(model, prompts, ids, mask, temperature, True, pad_token_id=0, attention_backend="sdpa")

    return run


def values_and_grads(fn, model, batch):
    prompts, ids, mask = batch
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, prompts, ids, mask.to(model.dtype), TEMPERATURE)
    g = torch.Generator().manual_seed(1)
    w_lp, w_ent = (torch.randn(ids.shape, generator=g, dtype=lp.dtype) for _ in range(2))
    ((w_lp * lp * mask).sum() + (w_ent * ent * mask).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return lp.detach() * mask, ent.detach() * mask, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("path", ["naive", "zorro"])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_logprobs_entropies_and_gradients_equal_the_models_own_forward(kind, path, dtype):
    prompts, ids, mask = make_batch(*BATCH)
    model = build_family(kind, dtype)
    assert head_transform(model) == EXPECTED_HEAD[kind]
    ref = values_and_grads(own_forward_logprobs, model, (prompts, ids, mask))
    ours = values_and_grads(path_logprobs(path), twin(model), (prompts, ids, mask))
    atol, tol = TOLERANCE[dtype]
    assert ours[0].dtype == ref[0].dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(ours[0], ref[0], atol=atol, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=atol, rtol=0)
    assert ref[2].keys() == ours[2].keys() and len(ref[2]) == len(list(model.parameters()))
    for name, grad in ref[2].items():  # absolute tolerance relative to the tensor's scale (MoE grads reach ~100)
        scaled = dict(atol=tol["atol"] * max(1.0, grad.abs().max().item()), rtol=tol["rtol"])
        torch.testing.assert_close(ours[2][name], grad, **scaled, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", ["granite", "granitemoe", "gemma2", "gemma3_text", "minicpm3"])
def test_the_heads_post_processing_changes_the_logprobs(kind):
    """Guard against a vacuous comparison: without the head transform the log-probs are far off."""
    from arctic_rl.zorro.logprobs import chunked_token_logprobs

    model = build_family(kind, torch.float64)
    hidden = torch.randn(20, model.config.hidden_size, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (20,))
    with torch.no_grad():
        plain, _ = chunked_token_logprobs(hidden, targets, model.get_output_embeddings(), 1.0, False)
        right, _ = chunked_token_logprobs(
            hidden, targets, model.get_output_embeddings(), 1.0, False, transform=head_transform(model)
        )
    assert (plain - right).abs().max() > 0.05


def test_unknown_head_post_processing_is_refused_by_name():
    from transformers import LlamaForCausalLM

    class TripledLogitsLlama(LlamaForCausalLM):  # scales by 3: no config value says so
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3.0
            return out

    base = build_family("llama", torch.float32)
    model = TripledLogitsLlama(base.config)
    with pytest.raises(UnsupportedLogitTransform, match=r"model type 'llama' \(TripledLogitsLlama\).*does not reproduce"):
        head_transform(model)


def test_the_measurement_runs_without_dropout_and_keeps_train_mode():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**FAMILIES["llama"], "attention_dropout": 0.5})
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).train()
    assert head_transform(model) == HeadTransform() and model.training
