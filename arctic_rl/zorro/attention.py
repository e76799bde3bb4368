"""ZoRRo attention, registered in transformers' ``AttentionInterface`` (no per-family patches).

``install_zorro_attention(model)`` resolves each layer's ``AttentionFeatures`` (window, soft-cap,
sinks: ``features.py``; unsupported patterns raise ``ZorroUnsupportedModel``) and switches the
model to the ``"zorro"`` implementation once (it stays: activation recomputation in backward reads
the implementation again). Under it, with ``attention_mask`` a ``PackedMask`` (a ZoRRo forward;
transformers hands a 4D mask straight to the attention function), each layer computes its own
features on the packed row, one code path per backend:

* ``sdpa`` (CPU reference): ``eager_attention`` with the layer's dense mask (window included);
  soft-cap and sinks in plain torch, as the families' own eager functions.
* ``flex``: compiled ``flex_attention`` with the layer's block mask (window included), the
  soft-cap as ``score_mod``, sinks from flex's log-sum-exp (``flex_layer_attention``).
* ``flash`` / ``cudnn`` (cascade attention, ``cascade.py``): full layers on the fused kernels, with
  sinks merged exactly as one more part; layers with a window or soft-cap (which the cascade parts
  do not express) run on flex over the same row, logged once. Never a full-attention result for a
  windowed layer.

Any other mask (generation, a naive padded forward through the switched model): transformers' own
SDPA function, or ``eager_attention`` for soft-capped / sink layers that SDPA cannot express.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch

from arctic_rl.zorro.cascade import cascade_attention
from arctic_rl.zorro.features import AttentionFeatures, ZorroUnsupportedModel, check_layer_call, resolve_layer_features
from arctic_rl.zorro.linear_attention import install_linear_attention
from arctic_rl.zorro.packed_mask import PackedMask

ZORRO_ATTENTION = "zorro"
_active_forward: list[int] = []  # call counter of the ZoRRo forward in progress (one at a time)
_flex_fallbacks_logged: set[tuple[str, str]] = set()
logger = logging.getLogger(__name__)

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
    if not isinstance(attention_mask, PackedMask):
        return _ordinary_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    layer, features = attention_mask.layer_features(module)
    check_layer_call(features, attention_mask.model_type, layer, dropout, kwargs)
    if _active_forward:
        _active_forward[-1] += 1
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sp = attention_mask.sequence_parallel
    if sp is None:
        return packed_attention(query, key, value, attention_mask, features, scale, kwargs.get("s_aux")), None
    # Ulysses (sequence_parallel.py): my rows, all heads -> all rows, my heads; the same backend; and back
    key, value = sp.split_kv_heads(key), sp.split_kv_heads(value)  # fewer key/value heads than ranks: repeated
    query, key, value = (sp.seq_to_heads(x) for x in (query, key, value))
    out = packed_attention(query, key, value, attention_mask, features, scale, sp.local_heads(kwargs.get("s_aux")))
    return sp.heads_to_seq(out), None


def packed_attention(query, key, value, attention_mask: PackedMask, features: AttentionFeatures, scale: float, sinks):
    """One layer's attention over the whole packed row on ``attention_mask.kernel``: ``query [B, Hq, T, D]``,
    ``key/value [B, Hkv, T, D]``, ``sinks [Hq]`` or None -> ``[B, T, Hq, D]``."""
    kernel = attention_mask.kernel
    if kernel in ("flash", "cudnn") and features.window is None and features.softcap is None:  # sinks merge exactly
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
        return cascade_attention(q, k, v, attention_mask.plan, scale, kernel, sinks)[None]
    if kernel == "sdpa":
        mask = attention_mask.dense_mask(features.window)
        return eager_attention(query, key, value, mask, scale, features.softcap, sinks)
    if kernel != "flex":
        _log_flex_fallback(kernel, features, attention_mask.model_type)
    block_mask = attention_mask.block_mask(features.window)
    return flex_layer_attention(query, key, value, block_mask, scale, features.softcap, sinks)


def _ordinary_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    """Forwards without a ``PackedMask`` (generation, a naive padded batch): transformers' SDPA,
    or, for a soft-capped / sink layer (which SDPA cannot express), ``eager_attention``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout > 0:
        raise ValueError(f"attention dropout {dropout} > 0 with soft-cap / sinks is not supported by the 'zorro' implementation")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return eager_attention(query, key, value, attention_mask, scale, softcap, sinks), None


def eager_attention(query, key, value, mask, scale: float, softcap: float | None = None, sinks=None) -> torch.Tensor:
    """Plain-torch attention with every feature: ``query [B, Hq, T, D]``, ``key/value [B, Hkv, S, D]``,
    ``mask`` bool ``[., ., T, S]`` (True = attend), additive float, or None (causal, aligned to the
    last key) -> ``[B, T, Hq, D]``. Scores are soft-capped before the mask, as Gemma2's eager path;
    sinks join the softmax as one zero-value logit per head, as gpt-oss' eager path. With neither,
    torch's SDPA kernel (same math)."""
    t, s = query.shape[-2], key.shape[-2]
    if mask is None:
        mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
    if softcap is None and sinks is None and mask.dtype == torch.bool:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
        )
        return out.transpose(1, 2).contiguous()
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask[..., :s]
    acc = torch.promote_types(scores.dtype, torch.float32)
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores.to(acc), dim=-1).to(value.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


@functools.cache
def _softcap_score_mod(softcap: float):
    """One ``score_mod`` object per cap value (a new closure per call would retrace flex)."""

    def score_mod(score, batch, head, q_idx, kv_idx):
        return torch.tanh(score / softcap) * softcap

    return score_mod


def flex_layer_attention(query, key, value, block_mask, scale: float, softcap: float | None = None, sinks=None):
    """Compiled FlexAttention with ``block_mask`` (over ``T`` rows, or over ``T`` rounded up to its
    block size: the extra rows are zero padding, cut off again), the soft-cap as ``score_mod``, and
    sinks applied from the log-sum-exp: with ``lse`` over the visible keys, adding a sink logit
    ``s`` rescales the output by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)`` (gradients
    reach ``q``/``k`` through flex's ``lse`` and the sink parameter directly) -> ``[B, T, Hq, D]``."""
    from torch.nn.attention.flex_attention import AuxRequest

    t, length = query.shape[-2], block_mask.seq_lengths[0]
    if length != t:
        query, key, value = (torch.nn.functional.pad(x, (0, 0, 0, length - t)) for x in (query, key, value))
    out = compiled_flex_attention()(
        query, key, value, score_mod=None if softcap is None else _softcap_score_mod(float(softcap)),
        block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1],
        kernel_options=_flex_kernel_options(length, length),
        **({} if sinks is None else {"return_aux": AuxRequest(lse=True)}),
    )
    if sinks is not None:
        out, aux = out
        weight = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[None, :, None])  # [B, H, L], lse is fp32
        out = out * weight.to(out.dtype)[..., None]
    return out[:, :, :t].transpose(1, 2).contiguous()


def _log_flex_fallback(kernel: str, features: AttentionFeatures, model_type: str) -> None:
    key = (kernel, features.describe())
    if key not in _flex_fallbacks_logged:
        _flex_fallbacks_logged.add(key)
        logger.warning(
            "ZoRRo '%s' kernels have no %s: model type '%s' runs those layers on FlexAttention over the same row",
            kernel, features.describe(), model_type,
        )


def _flex_kernel_options(q_len: int, kv_len: int) -> dict | None:
    """``IS_DIVISIBLE``: the packed row is padded to a multiple of 128 (``FLEX_BLOCK_SIZE``), but a
    dynamic-shape compile cannot prove it and would emit bounds-checked loads; telling the kernel
    made flex fwd+bwd 12-20% faster per layer on an H200 (BENCHMARKS.md). Only when it holds."""
    return {"IS_DIVISIBLE": True} if q_len % 128 == 0 and kv_len % 128 == 0 else None


def register_zorro_attention() -> None:
    """Register ``"zorro"`` in transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ZORRO_ATTENTION, zorro_attention)
    AttentionMaskInterface.register(ZORRO_ATTENTION, sdpa_mask)


def install_zorro_attention(model: torch.nn.Module) -> tuple[AttentionFeatures, ...]:
    """Check ``model`` and switch it to the ``"zorro"`` attention implementation (and a hybrid's
    linear-attention layers to per-segment states); returns each decoder layer's ``AttentionFeatures``
    (``features.py``). Ordinary (non-ZoRRo) forwards keep
    SDPA semantics afterwards (eager math for soft-capped / sink layers)."""
    model_type = model.config.model_type
    features = resolve_layer_features(model)
    hybrid = any(f.linear for f in features)
    if hybrid:
        install_linear_attention(model)  # gated DeltaNet layers: per-segment states (linear_attention.py)
    # transformers marks hybrids as not backend-compatible because their linear layers bypass AttentionInterface;
    # their softmax layers do route through it, which every ZoRRo forward checks by counting the calls
    if not hybrid and not type(model).is_backend_compatible():
        raise ZorroUnsupportedModel(
            f"model type '{model_type}' ({type(model).__name__}) does not route attention through transformers' "
            "AttentionInterface, so ZoRRo cannot apply its packed mask; use the naive path for it"
        )
    register_zorro_attention()
    if model.config._attn_implementation != ZORRO_ATTENTION:
        model.set_attn_implementation(ZORRO_ATTENTION)
    if model.config._attn_implementation != ZORRO_ATTENTION:
        raise ZorroUnsupportedModel(f"model type '{model_type}' refused attention implementation '{ZORRO_ATTENTION}'")
    return features


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
