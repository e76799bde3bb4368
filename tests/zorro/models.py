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


def build_tiny(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """A seeded random tiny causal LM of family ``kind`` (``sdpa`` attention, train mode)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIGS[kind])
    config._attn_implementation = "sdpa"
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
