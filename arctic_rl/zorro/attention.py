"""ZoRRo attention, registered in transformers' ``AttentionInterface`` (no per-family patches).

``install_zorro_attention(model)`` switches a model to the ``"zorro"`` implementation once (it
stays: activation recomputation in backward reads the implementation again). Under it:

* ``attention_mask`` is a FlexAttention ``BlockMask`` (a ZoRRo forward with the flex backend):
  compiled ``flex_attention`` with that mask; GQA handled by the kernel.
* anything else (a ZoRRo dense boolean mask, or ordinary padding masks / ``None`` from
  transformers' ``sdpa_mask``, registered for ``"zorro"`` too): transformers' own SDPA function,
  so generation or a naive forward through the same model behave exactly as with ``"sdpa"``.

* ``attention_mask`` is a ``cascade.CascadeMask`` (the ``cudnn`` and ``flash_varlen`` backends):
  cascade attention over cuDNN's / FlashAttention-2's fused kernels on a prompts-first row
  (``cascade.py``).

transformers hands a 4D mask (tensor or BlockMask) straight to the attention function, which is
how the packed layout reaches every layer without new kwargs.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from arctic_rl.zorro.cascade import CascadeMask, cascade_attention

ZORRO_ATTENTION = "zorro"
SUPPORTED_LAYER_TYPES = {"full_attention"}
_active_forward: list[int] = []  # call counter of the ZoRRo forward in progress (one at a time)


class ZorroUnsupportedModel(ValueError):
    """The model cannot run the packed layout correctly; the message names the model type."""


FLEX_COMPILE_ENV = "ARCTIC_RL_ZORRO_FLEX_COMPILE"  # auto (default) | static | max-autotune


@functools.cache
def compiled_flex_attention():
    """``flex_attention`` compiled once per process (uncompiled flex materialises the scores).

    ``auto``: the second packed length seen recompiles with a symbolic length, so varying
    micro-batch lengths do not recompile every step. ``static``: one kernel per length (fastest
    per call, but past torch's recompile limit it falls back to slow eager). ``max-autotune``:
    autotunes the kernel's tiles (minutes of compile per shape)."""
    from torch.nn.attention.flex_attention import flex_attention

    mode = os.environ.get(FLEX_COMPILE_ENV, "auto")
    if mode == "auto":
        return torch.compile(flex_attention)
    if mode == "static":
        return torch.compile(flex_attention, dynamic=False)
    if mode == "max-autotune":
        return torch.compile(flex_attention, mode="max-autotune-no-cudagraphs")
    raise ValueError(f"{FLEX_COMPILE_ENV} must be auto, static or max-autotune, got {mode!r}")


def zorro_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention function with transformers' signature: ``query [B, Hq, T, D]``, ``key/value
    [B, Hkv, T, D]`` -> ``(out [B, T, Hq, D], None)``."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _active_forward:
        _active_forward[-1] += 1
        _check_layer_kwargs(module, dropout, kwargs)
    if isinstance(attention_mask, CascadeMask):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cascade_attention(q, k, v, attention_mask.plan, scale, attention_mask.kernel)[None], None
    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = compiled_flex_attention()(
        query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=_flex_kernel_options(query.shape[-2], key.shape[-2]),
    )
    return out.transpose(1, 2).contiguous(), None


def _flex_kernel_options(q_len: int, kv_len: int) -> dict | None:
    """``IS_DIVISIBLE``: the packed row is padded to a multiple of 128 (``FLEX_BLOCK_SIZE``), but a
    dynamic-shape compile cannot prove it and would emit bounds-checked loads; telling the kernel
    made flex fwd+bwd 12-20% faster per layer on an H200 (BENCHMARKS.md). Only when it holds."""
    return {"IS_DIVISIBLE": True} if q_len % 128 == 0 and kv_len % 128 == 0 else None


def _check_layer_kwargs(module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
    """Reject per-layer features the packed mask does not express (checked on the first forward)."""
    model_type = module.config.model_type
    if kwargs.get("sliding_window") is not None:
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': layer uses sliding-window attention (window {kwargs['sliding_window']}), "
            "which the ZoRRo packed mask does not apply; disable the window or use the naive path"
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ZorroUnsupportedModel(f"model type '{model_type}': attention uses '{name}', not supported by ZoRRo")
    if dropout > 0:
        raise ZorroUnsupportedModel(f"model type '{model_type}': attention dropout {dropout} > 0 is not supported by ZoRRo")


def register_zorro_attention() -> None:
    """Register ``"zorro"`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ZORRO_ATTENTION, zorro_attention)
    AttentionMaskInterface.register(ZORRO_ATTENTION, sdpa_mask)


def attention_layer_count(model: torch.nn.Module) -> int:
    """Decoder layers whose attention a ZoRRo forward must see; errors for unsupported models."""
    config = model.config
    model_type = config.model_type
    if not type(model).is_backend_compatible():
        raise ZorroUnsupportedModel(
            f"model type '{model_type}' ({type(model).__name__}) does not route attention through transformers' "
            "AttentionInterface, so ZoRRo cannot apply its packed mask; use the naive path for it"
        )
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    unsupported = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if unsupported:
        raise ZorroUnsupportedModel(
            f"model type '{model_type}' has {unsupported} layers; ZoRRo supports decoders whose every layer is full "
            "softmax attention (linear-attention / recurrent / sliding-window layers would ignore the packed mask)"
        )
    return len(layer_types)


def install_zorro_attention(model: torch.nn.Module) -> int:
    """Check ``model`` and switch it to the ``"zorro"`` attention implementation; returns the number
    of attention layers. Ordinary (non-ZoRRo) forwards keep SDPA semantics afterwards."""
    layers = attention_layer_count(model)
    register_zorro_attention()
    if model.config._attn_implementation != ZORRO_ATTENTION:
        model.set_attn_implementation(ZORRO_ATTENTION)
    if model.config._attn_implementation != ZORRO_ATTENTION:
        raise ZorroUnsupportedModel(
            f"model type '{model.config.model_type}' refused attention implementation '{ZORRO_ATTENTION}'"
        )
    return layers


@contextlib.contextmanager
def counting_zorro_calls() -> Iterator[list[int]]:
    """Count attention calls during one ZoRRo forward (``counter[0]`` after the block)."""
    if _active_forward:
        raise RuntimeError("nested ZoRRo forwards are not supported")
    _active_forward.append(0)
    counter = [0]
    try:
        yield counter
    finally:
        counter[0] = _active_forward.pop()
