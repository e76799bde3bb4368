"""The transformers engine's attention function: transformers' SDPA attention, except for one-token decode
steps of grouped-query models. There transformers repeats every key/value head to the query heads' count
before a masked SDPA call (``repeat_kv``: a copy of the whole KV window per layer per step). Here the query
heads that share a key/value head are laid out as that head's query rows, so SDPA reads the cache as it is.

Registered with transformers' ``AttentionInterface`` (and its mask interface, with SDPA's masks) under
:data:`NAME`; the engine loads its model with ``attn_implementation=NAME``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "arctic_rl_decode_sdpa"


def decode_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """``query`` ``[b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, k, d]``; returns ``[b, q, heads, d]``
    as transformers' attention functions do. Exact: the same SDPA over the same keys, grouped differently."""
    b, heads, q_len, d = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.view(b, kv_heads, heads // kv_heads, d)  # query head h uses key/value head h // (heads / kv_heads)
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(b, heads, 1, d).transpose(1, 2), None


AttentionInterface.register(NAME, decode_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)
