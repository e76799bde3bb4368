"""Tiny seeded decoders built from configs (no hub) and the batches the equivalence tests use."""

from __future__ import annotations

import copy

import torch

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
)
CONFIGS = {
    "qwen3": dict(model_type="qwen3", intermediate_size=48, tie_word_embeddings=True, **COMMON),
    "qwen3_moe": dict(
        model_type="qwen3_moe", intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, tie_word_embeddings=False, **COMMON,
    ),
    "llama": dict(model_type="llama", intermediate_size=48, tie_word_embeddings=False, **COMMON),
}
WINDOW = 4  # shorter than the family tests' prompts
FAMILY_CONFIGS = {  # windows, soft-caps, sinks and head post-processing, tiny
    "mistral": dict(model_type="mistral", intermediate_size=48, sliding_window=WINDOW, **COMMON),
    "qwen2": dict(model_type="qwen2", intermediate_size=48, use_sliding_window=True, sliding_window=WINDOW,
                  max_window_layers=1, **COMMON),  # layer 0 full, layer 1 windowed
    "gemma2": dict(model_type="gemma2", intermediate_size=48, sliding_window=WINDOW, query_pre_attn_scalar=8,
                   attn_logit_softcapping=1.5, final_logit_softcapping=2.0, pad_token_id=0, **COMMON),
    "gemma3_text": dict(model_type="gemma3_text", intermediate_size=48, sliding_window=WINDOW, sliding_window_pattern=2,
                        query_pre_attn_scalar=8, pad_token_id=0, **COMMON),
    "olmo2": dict(model_type="olmo2", intermediate_size=48, pad_token_id=0, **COMMON),
    "phi3": dict(model_type="phi3", intermediate_size=48, sliding_window=WINDOW, pad_token_id=0,
                 **{k: v for k, v in COMMON.items() if k != "head_dim"}),
    "gpt_oss": dict(model_type="gpt_oss", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=WINDOW, pad_token_id=0, **COMMON),  # alternating sliding / full layers, sinks
    "granite": dict(model_type="granite", intermediate_size=48, logits_scaling=4.0, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.3, pad_token_id=0, **COMMON),
    "phimoe": dict(model_type="phimoe", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                   sliding_window=WINDOW, pad_token_id=0, **{k: v for k, v in COMMON.items() if k != "head_dim"}),
}
CONFIGS.update(FAMILY_CONFIGS)
HYBRID = dict(  # gated DeltaNet (linear attention) layers 0 and 2 around a full-attention layer 1
    layer_types=["linear_attention", "full_attention", "linear_attention"], linear_conv_kernel_dim=4,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, intermediate_size=48,
    **{**COMMON, "num_hidden_layers": 3, "max_position_embeddings": 256},
)
HYBRID_CONFIGS = {
    "qwen3_next": dict(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, decoder_sparse_step=2, **HYBRID),  # MoE on layer 1
    "qwen3_5_text": dict(model_type="qwen3_5_text", **HYBRID),
}
CONFIGS.update(HYBRID_CONFIGS)


def build_tiny(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A seeded random tiny causal LM of family ``kind`` (``sdpa`` attention unless told, train mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIGS[kind])
    config._attn_implementation = attn_implementation
    if dtype == torch.float64:  # torch's grouped_mm (the default MoE experts path) has no float64 kernel
        config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    with torch.no_grad():  # make the weights non-trivial everywhere (some inits are zeros / ones)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def twin(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy (one side runs naive SDPA, the other ZoRRo)."""
    return copy.deepcopy(model)


def make_batch(prompt_lengths: list[int], prompt_of: list[int], response_lengths: list[int], seed: int = 0,
               device: str = "cpu"):
    """Samples ``i`` with prompt number ``prompt_of[i]`` (of length ``prompt_lengths[...]``) and a
    response of ``response_lengths[i]`` tokens, right-padded to the longest with token 0."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    r = max(max(response_lengths), 1)
    response_ids = torch.zeros(len(prompt_of), r, dtype=torch.long)
    mask = torch.zeros(len(prompt_of), r)
    for i, length in enumerate(response_lengths):
        response_ids[i, :length] = torch.randint(1, VOCAB, (length,), generator=g)
        mask[i, :length] = 1.0
    return [prompts[k] for k in prompt_of], response_ids.to(device), mask.to(device)
