"""Per-layer attention features ZoRRo must reproduce (sliding window, score soft-cap, learned sinks),
resolved once from a transformers model and checked against what each layer passes at run time.

A ZoRRo forward hands every layer the same packed mask (``packed_mask.py``), so whatever a family
would put in its own per-layer mask has to be known here, *before* the forward, from the config:

* ``window`` (``W``): a query at position ``p`` of its own sequence sees keys at positions
  ``p - W + 1 .. p`` (``W`` keys, itself included): transformers' ``sliding_window_overlay``
  (``kv_idx > q_idx - sliding_window``), which is also what its flash path gets
  (``window_size = (W - 1, W - 1)``). Families: ``layer_types`` entries ``"sliding_attention"``
  take ``config.sliding_window`` (Qwen2/Qwen3 ``use_sliding_window``, Gemma2/3, gpt-oss, Cohere2,
  ...); without ``layer_types``, a config ``sliding_window`` is applied to *every* layer by
  families whose forward builds ``create_sliding_window_causal_mask`` from it (Mistral, Mixtral,
  Phi3, Starcoder2, Qwen3-MoE, and PhiMoE / Doge, which apply it *only* in that mask, never as an
  attention argument). A config window with a forward that builds no such mask
  is refused: we cannot tell where it applies.
* ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma2
  ``attn_logit_softcapping``).
* ``sinks``: the attention module owns a per-head ``sinks`` parameter that joins the softmax
  denominator as one extra logit with a zero value (gpt-oss ``s_aux``).
* ``linear``: a ``layer_types`` entry ``"linear_attention"`` (Qwen3-Next, Qwen3.5): a gated DeltaNet
  layer, which takes no mask; ``linear_attention.py`` runs it segment by segment.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

WINDOWED, FULL, LINEAR = "sliding_attention", "full_attention", "linear_attention"
WINDOW_MASK_BUILDER = "create_sliding_window_causal_mask"  # transformers.masking_utils


class ZorroUnsupportedModel(ValueError):
    """The model cannot run the packed layout correctly; the message names the model type."""


@dataclass(frozen=True)
class AttentionFeatures:
    """What one attention layer computes beyond plain causal softmax attention (module docstring)."""

    window: int | None = None  # keys at positions p - window + 1 .. p of the query's own sequence
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before masking
    sinks: bool = False  # the layer passes a per-head sink logit (``s_aux``) joining the softmax
    linear: bool = False  # a linear-attention (gated DeltaNet) layer: no attention call, see linear_attention.py

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and not self.sinks and not self.linear

    def describe(self) -> str:
        if self.linear:
            return "linear attention"
        parts = [f"window {self.window}"] if self.window is not None else []
        parts += [f"soft-cap {self.softcap}"] if self.softcap is not None else []
        return ", ".join(parts + (["attention sinks"] if self.sinks else [])) or "full causal"


def resolve_layer_features(model: torch.nn.Module) -> tuple[AttentionFeatures, ...]:
    """One ``AttentionFeatures`` per decoder layer of ``model``; ``ZorroUnsupportedModel`` for any
    attention pattern the packed mask cannot express (bidirectional, chunked, recurrent)."""
    config = model.config
    text = config.get_text_config()
    model_type = config.model_type
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", False):
        raise ZorroUnsupportedModel(f"model type '{model_type}' attends bidirectionally; ZoRRo packs causal decoders only")
    windows = _layer_windows(model, text, model_type)
    softcap = getattr(text, "attn_logit_softcapping", None)
    sink_layers = _sink_layers(model, model_type)
    linear = {i for i, kind in enumerate(getattr(text, "layer_types", None) or []) if kind == LINEAR}
    return tuple(
        AttentionFeatures(linear=True) if i in linear else
        AttentionFeatures(window=w, softcap=None if softcap is None else float(softcap), sinks=i in sink_layers)
        for i, w in enumerate(windows)
    )


def _layer_windows(model: torch.nn.Module, text, model_type: str) -> list[int | None]:
    layer_types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if layer_types:
        unsupported = sorted(set(layer_types) - {FULL, WINDOWED, LINEAR})
        if unsupported:
            raise ZorroUnsupportedModel(
                f"model type '{model_type}' has {unsupported} layers; ZoRRo supports full and sliding-window softmax "
                "attention layers and gated DeltaNet linear-attention layers (recurrent / chunked layers would ignore "
                "the packed mask)"
            )
        if WINDOWED in layer_types and not (isinstance(window, int) and window > 0):
            raise ZorroUnsupportedModel(f"model type '{model_type}' has sliding_attention layers but sliding_window={window!r}")
        return [window if kind == WINDOWED else None for kind in layer_types]
    if window is None:
        return [None] * text.num_hidden_layers
    modeling = sys.modules[type(model).__module__]
    if not (isinstance(window, int) and window > 0) or not hasattr(modeling, WINDOW_MASK_BUILDER):
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': config sets sliding_window={window!r} without layer_types, and its forward "
            f"({modeling.__name__}) does not build transformers' {WINDOW_MASK_BUILDER}; ZoRRo cannot tell which "
            "layers apply the window. Use the naive path (zorro: false)"
        )
    return [window] * text.num_hidden_layers


def _sink_layers(model: torch.nn.Module, model_type: str) -> set[int]:
    """Layer indices whose attention module owns a ``sinks`` parameter (gpt-oss)."""
    layers = set()
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            index = getattr(module, "layer_idx", None)
            if not isinstance(index, int):
                raise ZorroUnsupportedModel(f"model type '{model_type}': attention sinks on '{name}' without a layer_idx")
            layers.add(index)
    return layers


def check_layer_call(features: AttentionFeatures, model_type: str, layer: int, dropout: float, kwargs: dict) -> None:
    """Compare what a layer passes to the attention function with its resolved features: a window,
    cap or sink the config did not announce (or a different one) is refused, not ignored."""
    passed_window = kwargs.get("sliding_window")
    if passed_window is not None and passed_window != features.window:
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': layer {layer} passes sliding_window={passed_window} but its config resolves to "
            f"{features.describe()}; ZoRRo would apply the wrong window"
        )
    passed_cap = kwargs.get("softcap")
    if (passed_cap is None) != (features.softcap is None) or (passed_cap is not None and float(passed_cap) != features.softcap):
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': layer {layer} passes softcap={passed_cap} but its config resolves to {features.describe()}"
        )
    if (kwargs.get("s_aux") is not None) != features.sinks:
        raise ZorroUnsupportedModel(
            f"model type '{model_type}': layer {layer} attention sinks (s_aux) do not match its modules ({features.describe()})"
        )
    if dropout > 0:
        raise ZorroUnsupportedModel(f"model type '{model_type}': attention dropout {dropout} > 0 is not supported by ZoRRo")
