"""The built-in losses: TRL's GRPO family (``grpo_family_loss``), registered under each of its names with
``register_loss``, as a plugin registers its losses (``loss_registry.py`` imports this module on its first
look-up). ``family_loss`` computes one from a ``LossInputs`` and a loss config of named values, which
``builtin_loss_settings`` checks key by key.

A built-in's config keys are ``LossConfig``'s fields (but ``loss_type``), ``Regularizers``' fields and the
per-sequence corrections of ``CorrectionConfig`` (``vllm_importance_sampling_*``, ``off_policy_mask_threshold``):
``fit`` passes its ``loss`` and ``regularizers`` sections (its corrections arrive as ``LossInputs.weights``), a
service request what it sends. Every error is a ``ConfigError`` naming the loss and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from functools import partial
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.corrections import PolicyWeights, correction_fits_loss, policy_weights, sampler_correction_metrics
from arctic_rl.loss_registry import LOSSES, LossAggregation, LossInputError, check_config_dict, register_loss
from arctic_rl.modules.losses import LossInputs, grpo_family_loss
from arctic_rl.options import CorrectionConfig, LossConfig, Regularizers

# GRPOModule's per-sequence corrections (TRL's names); the whole-batch ones (top_entropy_quantile,
# mask_truncated_completions, num_iterations) are the caller's to do: it chooses what a call's batch holds
CORRECTION_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                   "vllm_importance_sampling_clip_max", "off_policy_mask_threshold")
CLIP_RANGES = (("clip_low", 0.0, 1.0), ("clip_high", 0.0, math.inf))  # key, lowest allowed, first refused
REGULARIZER_KEYS = frozenset(f.name for f in fields(Regularizers))


def _builtin_loss_keys() -> dict[str, Any]:
    hints = {key: hint for key, hint in get_type_hints(LossConfig).items() if key != "loss_type"}
    hints["loss_aggregation"] = LossAggregation | None
    hints.update(get_type_hints(Regularizers))
    hints.update({key: hint for key, hint in get_type_hints(CorrectionConfig).items() if key in CORRECTION_KEYS})
    return hints


BUILTIN_LOSS_KEYS: dict[str, Any] = _builtin_loss_keys()  # config key -> type, for the built-in losses


def fit_loss_config(loss: LossConfig, regularizers: Regularizers) -> dict[str, Any]:
    """The loss config ``fit`` passes its loss: the ``loss`` and ``regularizers`` sections' fields but ``loss_type``."""
    sections = {f.name: getattr(loss, f.name) for f in fields(loss) if f.name != "loss_type"}
    return {**sections, **{f.name: getattr(regularizers, f.name) for f in fields(regularizers)}}


def builtin_loss_settings(name: str, config: Mapping[str, Any]) -> tuple[LossConfig, Regularizers]:
    """``grpo_family_loss``'s settings for built-in loss ``name`` from ``config`` (see the module docstring).

    Raises:
        ConfigError: naming an unknown key, a value of the wrong type, or a value out of range.
    """
    check_config_dict(name, config)
    unknown = sorted(set(config) - set(BUILTIN_LOSS_KEYS))
    if unknown:
        raise ConfigError(f"loss {name!r}: unknown config key{'s' * (len(unknown) > 1)} {', '.join(unknown)};"
                          f" known: {', '.join(sorted(BUILTIN_LOSS_KEYS))}")
    for key, value in config.items():
        if not _conforms(value, BUILTIN_LOSS_KEYS[key]):
            raise ConfigError(f"loss {name!r}: config {key} must be {_hint_text(BUILTIN_LOSS_KEYS[key])}, got {value!r}")
    regularizers = Regularizers(**{key: value for key, value in config.items() if key in REGULARIZER_KEYS})
    for key, coef in (("kl_coef", regularizers.kl_coef), ("entropy_coef", regularizers.entropy_coef)):
        if coef < 0:
            raise ConfigError(f"loss {name!r}: config {key} must be >= 0, got {coef}")
    for key, low, high in CLIP_RANGES:  # the ratio is clipped to [1 - clip_low, 1 + clip_high]: a non-empty range
        if key in config and not low <= config[key] < high:
            raise ConfigError(f"loss {name!r}: config {key} must be in [{low:g}, {high:g}), got {config[key]}")
    try:
        loss_config = LossConfig(loss_type=name, **{key: value for key, value in config.items() if key in LossConfig.field_names()})
    except ValueError as e:  # LossConfig's own checks name the key
        raise ConfigError(f"loss {name!r}: config {e}") from None
    return loss_config, regularizers


def regularizer_needs(name: str, config: Mapping[str, Any]) -> set[str]:
    """Built-in loss ``name``'s optional inputs: ``entropy`` when ``entropy_coef > 0``, ``ref_logprobs`` when ``kl_coef > 0``
    (``ConfigError`` for a bad config)."""
    _, regularizers = builtin_loss_settings(name, config)
    return {need for need, coef in (("entropy", regularizers.entropy_coef), ("ref_logprobs", regularizers.kl_coef)) if coef > 0}


def family_loss(name: str, aggregation: LossAggregation, inputs: LossInputs,
                config: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``grpo_family_loss`` with ``loss_type=name`` and normaliser ``aggregation`` (``config``'s
    ``loss_aggregation`` overrides it); entropy enters only when ``entropy_coef > 0`` and the reference only
    when ``kl_coef > 0``. The weights are ``config``'s corrections when it asks for any, else ``inputs.weights``."""
    loss_config, regularizers = builtin_loss_settings(name, config)
    if regularizers.kl_coef > 0 and inputs.ref_logprobs is None:
        raise LossInputError(f"loss {name!r}: config kl_coef={regularizers.kl_coef} needs ref_logprobs", "ref_logprobs")
    if regularizers.entropy_coef > 0 and inputs.entropy is None:
        raise LossInputError(f"loss {name!r}: config entropy_coef={regularizers.entropy_coef} needs entropy", "entropy")
    weights, correction_stats = correction_weights(name, inputs, config)
    loss, stats = grpo_family_loss(
        loss_config, loss_config.loss_aggregation or aggregation, regularizers, inputs.logprobs, inputs.old_logprobs,
        inputs.advantages, inputs.mask, inputs.normalizer,
        ref_logprobs=inputs.ref_logprobs if regularizers.kl_coef > 0 else None,
        entropy=inputs.entropy if regularizers.entropy_coef > 0 else None,
        weights=inputs.weights if weights is None else weights,
    )
    return loss, {**stats, **correction_stats}


def correction_weights(name: str, inputs: LossInputs, config: Mapping[str, Any]) -> tuple[PolicyWeights | None, dict[str, torch.Tensor]]:
    """The mismatch correction and off-policy mask a built-in loss's ``config`` asks for (``GRPOModule``'s,
    TRL's names), from ``inputs.sampler_logprobs``, and TRL's ``sampling/*`` metrics of the correction;
    ``(None, {})`` when it asks for neither."""
    try:
        cfg = CorrectionConfig(**{key: config[key] for key in CORRECTION_KEYS if key in config})
    except ValueError as e:  # names the key as model.<key>
        raise ConfigError(f"loss {name!r}: config {str(e).removeprefix('model.')}") from None
    if not cfg.vllm_importance_sampling_correction and cfg.off_policy_mask_threshold is None:
        return None, {}
    if inputs.sampler_logprobs is None:
        raise ConfigError(f"loss {name!r}: config vllm_importance_sampling_correction / off_policy_mask_threshold need"
                          " batch.sampler_logprobs (the engine's log-probs: Samples.flat_logprobs())")
    if not correction_fits_loss(name, cfg.vllm_importance_sampling_correction, cfg.vllm_importance_sampling_mode):
        raise ConfigError("loss 'vespo': config vllm_importance_sampling_mode must be token_truncate or token_mask (as in TRL)")
    weights = policy_weights(cfg, inputs.advantages, inputs.logprobs, inputs.old_logprobs, inputs.sampler_logprobs, inputs.mask)
    if not cfg.vllm_importance_sampling_correction:
        return weights, {}
    metrics = sampler_correction_metrics(inputs.old_logprobs, inputs.sampler_logprobs, inputs.mask, weights.importance)
    return weights, {key: torch.tensor(value) for key, value in metrics.items()}


def _conforms(value: object, hint: Any) -> bool:
    """Whether a config value fits a ``LossConfig``/``Regularizers`` field type (no coercion; bools are not numbers)."""
    origin = get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in get_args(hint))
    if origin in (Union, UnionType):
        return any(_conforms(value, arg) for arg in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    raise TypeError(f"no check for config type {hint!r}; teach _conforms")  # a new LossConfig field type


def _hint_text(hint: Any) -> str:
    origin = get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in get_args(hint))
    if origin in (Union, UnionType):
        return " or ".join(_hint_text(arg) for arg in get_args(hint))
    return {type(None): "null", bool: "true or false", float: "a finite number"}[hint]


# What each normalises by (TRL's choices; docs/algorithms.md's table says where each comes from)
for _name, _aggregation in (
    ("grpo", "sequence_mean"),  # mean over sequences of each sequence's token mean
    ("sapo", "sequence_mean"),
    ("bnpo", "token_mean"),  # tokens of the batch (TRL: of the local micro-batch; exact-global here, so = dapo)
    ("dapo", "token_mean"),  # tokens of the whole generation batch
    ("cispo", "token_mean"),
    ("vespo", "token_mean"),
    ("dr_grpo", "constant"),  # sequences x max_response_length
    ("luspo", "sequence_sum"),  # mean over sequences of each sequence's token sum
):
    if _name not in LOSSES:  # a reload keeps the first registration
        register_loss(_name, needs=partial(regularizer_needs, _name), aggregation=_aggregation, builtin=True)(
            partial(family_loss, _name, _aggregation))
