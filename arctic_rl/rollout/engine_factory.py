"""``make_engine``: starts the rollout engine a config names. Apart from ``engine.py`` (the boundary both
engines import), so the boundary never imports an implementation."""

from __future__ import annotations

import importlib.util
from typing import Any

from arctic_rl.rollout.engine import RolloutEngine


def make_engine(
    kind: str, model_path: str, *, dtype: str, max_model_len: int, seed: int, device: str, engine_kwargs: dict[str, Any]
) -> RolloutEngine:
    """Start the rollout engine ``kind`` (``auto``: vLLM when installed, else transformers)."""
    if kind == "auto":
        kind = "vllm" if importlib.util.find_spec("vllm") is not None else "transformers"
    if kind == "vllm":
        from arctic_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, **engine_kwargs)
    if kind == "transformers":
        from arctic_rl.rollout.hf_engine import TransformersEngine

        return TransformersEngine(model_path, dtype=dtype, device=device, **engine_kwargs)
    raise ValueError(f"RolloutCallback.engine must be 'auto', 'vllm' or 'transformers', got {kind!r}")
