"""Building a transformers causal LM from a path or a config dict: the one reader of a model's config. A leaf
module (imports nothing of ours but ``errors``) so the strategies that build models under ZeRO need nothing above them."""

from __future__ import annotations

from typing import Any

import torch


def causal_lm_config(model: str | dict[str, Any]):
    """The transformers config of ``model``: a config dict (``{"model_type": "qwen3", ...}``), or the
    ``config.json`` of a ``save_pretrained`` directory / hub id. Raises ``ConfigError`` for a dict without
    ``model_type``."""
    from transformers import AutoConfig

    from arctic_rl.errors import ConfigError

    if isinstance(model, dict):
        if "model_type" not in model:
            raise ConfigError(f"model.model: a config dict needs 'model_type' (e.g. 'qwen3'), got keys {sorted(model)}")
        return AutoConfig.for_model(**model)
    return AutoConfig.from_pretrained(model)


def build_causal_lm(model: str | dict[str, Any], dtype: str) -> torch.nn.Module:
    """A transformers causal LM from a ``save_pretrained`` directory / hub id, or from a config dict
    (``{"model_type": "qwen3", ...}``) with fresh random weights (seed first for reproducibility)."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if isinstance(model, dict):
        return AutoModelForCausalLM.from_config(causal_lm_config(dict(model)), dtype=torch_dtype)
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
