"""The checks of ``GRPOModule``'s settings made in its constructor, before any model, data or engine
exists: each bad value is a :class:`~arctic_rl.errors.ConfigError` naming ``model.<key>``, which
``arctic-rl`` prints as one line with exit status 2.

A value that trains without error but wrongly is refused here too: a negative ``max_grad_norm``
flips the update, ``clip_low >= 1`` removes the lower clip, a negative ``kl_coef`` or
``warmup_steps`` would be silently ignored, and a NaN anywhere only fails at the first loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from arctic_rl.errors import ConfigError, check_model_path, check_positive

DTYPES = ("float32", "bfloat16", "float16", "float64")  # the trainer's; float64 also needs engine: transformers (engine_factory)


def check_number(key: str, value: Any, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False) -> None:
    """``model.<key>`` must be a finite number within ``[low, high]`` (an ``_open`` end excludes its bound);
    ``None`` for ``low`` / ``high``: unbounded on that side. Raise a ``ConfigError`` naming it otherwise."""
    lo = "(" if low_open else "["
    hi = ")" if high_open else "]"
    wanted = f"{lo}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(f"model.{key} must be a finite number in {wanted}, got {value!r}")


def check_settings(hp: Mapping[str, Any]) -> None:
    """Every check of ``GRPOModule.__init__``'s arguments ``hp`` that needs no model, data or trainer."""
    check_positive(mini_batches=hp["mini_batches"], num_iterations=hp["num_iterations"],
                   max_response_length=hp["max_response_length"], max_prompt_length=hp["max_prompt_length"],
                   micro_batch_size=1 if hp["micro_batch_size"] is None else hp["micro_batch_size"])
    if hp["group_size"] < 2:
        raise ConfigError(f"model.group_size must be >= 2 (GRPO compares samples within a group), got {hp['group_size']}")
    if not 0 < hp["temperature"]:  # also refuses NaN
        raise ConfigError(f"model.temperature must be > 0, got {hp['temperature']}")
    if not 0 < hp["top_p"] <= 1:
        raise ConfigError(f"model.top_p must be in (0, 1], got {hp['top_p']}")
    if hp["micro_batch_size"] is not None and hp["micro_batch_tokens"] is not None:
        raise ConfigError("set model.micro_batch_size or model.micro_batch_tokens, not both")
    if hp["micro_batch_tokens"] is not None:
        check_positive(micro_batch_tokens=hp["micro_batch_tokens"])
    if hp["reward_call_timeout_s"] is not None:
        check_number("reward_call_timeout_s", hp["reward_call_timeout_s"], 0.0, low_open=True)
    if hp["dtype"] not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {hp['dtype']!r}")
    check_optimizer_settings(hp)
    check_loss_settings(hp)
    if hp["tokenizer"] is None and not isinstance(hp["model"], str):
        raise ConfigError("model.tokenizer is required when model.model is a config dict")
    for field, source in (("model.model", hp["model"]), ("model.tokenizer", hp["tokenizer"])):
        check_model_path(field, source)
    check_context_length(hp["model"], hp["max_prompt_length"], hp["max_response_length"])


def check_optimizer_settings(hp: Mapping[str, Any]) -> None:
    """The learning rate, its warm-up, weight decay and gradient clipping."""
    check_number("learning_rate", hp["learning_rate"], 0.0)
    check_number("weight_decay", hp["weight_decay"], 0.0)
    if not isinstance(hp["warmup_steps"], int) or hp["warmup_steps"] < 0:
        raise ConfigError(f"model.warmup_steps must be an integer >= 0, got {hp['warmup_steps']!r}")
    if hp["max_grad_norm"] is not None:  # 0 means no clipping, as in TRL and transformers
        check_number("max_grad_norm", hp["max_grad_norm"], 0.0)


def check_loss_settings(hp: Mapping[str, Any]) -> None:
    """The PPO clip range, the loss constants and the regularisers' weights."""
    from arctic_rl.modules.corrections import correction_fits_loss
    from arctic_rl.modules.losses import LossConfig

    check_number("clip_low", hp["clip_low"], 0.0, 1.0, high_open=True)  # ratio >= 1 - clip_low > 0
    check_number("clip_high", hp["clip_high"], 0.0)
    if hp["dual_clip"] is not None:
        check_number("dual_clip", hp["dual_clip"], 1.0, low_open=True)
    check_number("kl_coef", hp["kl_coef"], 0.0)  # 0: no reference model
    check_number("entropy_coef", hp["entropy_coef"])
    typed = {"loss_type", "importance_sampling_level", "clip_low", "clip_high", "dual_clip"}  # own arguments
    loss_kwargs = hp["loss_kwargs"] or {}
    unknown = set(loss_kwargs) - (LossConfig.field_names() - typed)
    if unknown:
        raise ConfigError(f"model.loss_kwargs: unknown keys {sorted(unknown)}; see arctic_rl.modules.losses.LossConfig")
    for key, value in loss_kwargs.items():
        check_number(f"loss_kwargs.{key}", value)
    if not correction_fits_loss(hp["loss_type"], hp["vllm_importance_sampling_correction"], hp["vllm_importance_sampling_mode"]):
        raise ConfigError("model.loss_type 'vespo' needs vllm_importance_sampling_mode token_truncate or token_mask (as in TRL)")


def context_length(model: str | dict[str, Any]) -> int | None:
    """The model's ``max_position_embeddings`` from its config alone (a config dict, or the
    ``config.json`` of a directory or hub id), without building it."""
    from arctic_rl.modules.models import causal_lm_config

    return getattr(causal_lm_config(model).get_text_config(), "max_position_embeddings", None)  # None: the model has no such limit


def check_context_length(model: str | dict[str, Any], max_prompt_length: int, max_response_length: int) -> None:
    """A prompt plus its response must fit the model's positions (and the engine's ``max_model_len``)."""
    limit = context_length(model)
    if limit is not None and max_prompt_length + max_response_length > limit:
        raise ConfigError(
            f"model.max_prompt_length + model.max_response_length = {max_prompt_length} + {max_response_length}"
            f" = {max_prompt_length + max_response_length} exceeds the model's max_position_embeddings={limit};"
            " lower them so they fit"
        )
