"""The service's pipeline registries: losses (``register_loss``) and post-forward processors
(``register_processor``), each a dict and a decorator, with the built-ins and plugin loading.

A request names a loss or processor; it can only pick a registered name, never an import path (nothing
here imports a string that came from a request). Names get registered three ways: the built-ins below
(the eight GRPO-family losses, the ``logprobs``/``entropy``/``ref_logprobs`` processors), decorators in
code the server imports, and plugins, which ``load_plugins()`` imports from installed packages' entry
points. A plugin package declares its module in its ``pyproject.toml``::

    [project.entry-points."arctic_rl.losses"]
    mine = "my_pkg.losses"          # my_pkg/losses.py runs @register_loss("mine", needs=("entropy",))

    [project.entry-points."arctic_rl.processors"]
    token_surprise = "my_pkg.processors"

and, once installed beside arctic-rl, requests may name ``"mine"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from functools import partial
from importlib.metadata import entry_points
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import torch

from arctic_rl.modules.corrections import (CorrectionConfig, PolicyWeights, correction_fits_loss, policy_weights,
                                           sampler_correction_metrics)
from arctic_rl.modules.losses import LOSS_AGGREGATION, LossAggregation, LossConfig, LossNormalizer, Regularizers, grpo_family_loss
from arctic_rl.serve.errors import RequestError, ServiceError

OPTIONAL_INPUTS = ("entropy", "ref_logprobs")  # what a loss or processor may ask the core to compute
PLUGIN_GROUPS = ("arctic_rl.losses", "arctic_rl.processors")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass
class LossInputs:
    """What a loss gets for one micro-batch; shapes are checked on construction (``RequestError``)."""

    logprobs: torch.Tensor  # [n, R] current policy log-probs (with grad)
    old_logprobs: torch.Tensor  # [n, R] policy before this batch's updates (ratio denominator)
    advantages: torch.Tensor  # [n] (or [n, R]: per token)
    mask: torch.Tensor  # [n, R] 1.0 on response tokens
    normalizer: LossNormalizer  # counts of the whole batch one optimizer step covers
    ref_logprobs: torch.Tensor | None = None  # [n, R] frozen reference policy (when the loss needs it)
    entropy: torch.Tensor | None = None  # [n, R] policy entropy per position (when the loss needs it)
    sampler_logprobs: torch.Tensor | None = None  # [n, R] the rollout engine's log-probs, when the request sent them

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        if len(shape) != 2:
            raise RequestError(f"mask: expected [n, R], got shape {shape}")
        _check_shape("advantages", self.advantages, (shape, shape[:1]))
        for name, tensor in (("logprobs", self.logprobs), ("old_logprobs", self.old_logprobs),
                             ("ref_logprobs", self.ref_logprobs), ("entropy", self.entropy),
                             ("sampler_logprobs", self.sampler_logprobs)):
            if tensor is not None:
                _check_shape(name, tensor, (shape,))


@dataclass
class ForwardContext:
    """What a processor gets after a forward pass over a batch of responses."""

    logprobs: torch.Tensor  # [n, R] log-probs of the response tokens
    entropy: torch.Tensor  # [n, R] entropy of the policy at each response position
    mask: torch.Tensor  # [n, R] 1.0 on response tokens
    response_ids: torch.Tensor  # [n, R] the response token ids
    ref_logprobs: torch.Tensor | None = None  # [n, R] reference log-probs (training.reference_model only)

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        if len(shape) != 2:
            raise RequestError(f"mask: expected [n, R], got shape {shape}")
        for name, tensor in (("logprobs", self.logprobs), ("entropy", self.entropy),
                             ("response_ids", self.response_ids), ("ref_logprobs", self.ref_logprobs)):
            if tensor is not None:
                _check_shape(name, tensor, (shape,))


def _check_shape(name: str, tensor: torch.Tensor, allowed: Iterable[tuple[int, ...]]) -> None:
    """Raise ``RequestError`` naming ``name`` unless ``tensor``'s shape is one of ``allowed``."""
    allowed = list(allowed)
    if tuple(tensor.shape) not in allowed:
        raise RequestError(f"{name}: expected shape {' or '.join(str(list(s)) for s in allowed)}, got {list(tensor.shape)}")


LossFn = Callable[[LossInputs, dict[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
ProcessorFn = Callable[[ForwardContext], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LossEntry:
    """A registered loss: its function, the optional inputs it always needs, whether it is built in."""

    fn: LossFn
    needs: frozenset[str]
    builtin: bool = False


@dataclass(frozen=True)
class ProcessorEntry:
    """A registered processor: its function, the optional inputs it needs, whether it is built in."""

    fn: ProcessorFn
    needs: frozenset[str]
    builtin: bool = False


LOSSES: dict[str, LossEntry] = {}
PROCESSORS: dict[str, ProcessorEntry] = {}
LOADED_PLUGINS: set[str] = set()  # "group:name = value" of the entry points imported so far


def _check_registration(table: dict[str, Any], kind: str, name: str, needs: Iterable[str], override: bool) -> frozenset[str]:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"{kind} name must be letters, digits, '_', '.' or '-', got {name!r}")
    if name in table and table[name].builtin:
        raise ValueError(f"{kind} {name!r} is built in and cannot be replaced; register yours under another name")
    if name in table and not override:
        raise ValueError(f"{kind} {name!r} is already registered ({table[name].fn!r}); pass override=True to replace it")
    if isinstance(needs, str):
        raise ValueError(f"{kind} {name!r}: needs must be a tuple of names, like ({needs!r},)")
    unknown = set(needs) - set(OPTIONAL_INPUTS)
    if unknown:
        raise ValueError(f"{kind} {name!r}: needs may only name {', '.join(OPTIONAL_INPUTS)}, got {sorted(unknown)}")
    return frozenset(needs)


def register_loss(name: str, *, needs: Iterable[str] = (), override: bool = False) -> Callable[[LossFn], LossFn]:
    """Register ``fn(inputs: LossInputs, config: dict) -> (loss, stats)`` under ``name``.

    ``loss`` is a scalar tensor normalised by ``inputs.normalizer`` (micro-batch losses sum to the
    batch loss); ``stats`` are scalar tensors to log. ``config`` is the request's loss config, as sent:
    the function checks it and raises ``RequestError`` naming a bad key.

    Args:
        name: what requests call it (letters, digits, ``_.-``).
        needs: optional inputs the core must compute for it: ``"entropy"``, ``"ref_logprobs"``.
        override: replace an earlier registration of ``name`` (built-in names are never replaced).

    Raises:
        ValueError: a bad name, an unknown need, or ``name`` taken.
    """
    def decorator(fn: LossFn) -> LossFn:
        LOSSES[name] = LossEntry(fn, _check_registration(LOSSES, "loss", name, needs, override))
        return fn

    return decorator


def register_processor(name: str, *, needs: Iterable[str] = (), override: bool = False) -> Callable[[ProcessorFn], ProcessorFn]:
    """Register ``fn(ctx: ForwardContext) -> {output name: tensor [n, R] or [n]}`` under ``name``; the
    arguments are ``register_loss``'s (``needs=("ref_logprobs",)`` when it reads ``ctx.ref_logprobs``)."""
    def decorator(fn: ProcessorFn) -> ProcessorFn:
        PROCESSORS[name] = ProcessorEntry(fn, _check_registration(PROCESSORS, "processor", name, needs, override))
        return fn

    return decorator


def _lookup(table: dict[str, Any], kind: str, group: str, name: object) -> Any:
    if not isinstance(name, str):
        raise RequestError(f"{kind} name must be a string, got {type(name).__name__}")
    if name not in table:
        raise RequestError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}"
                           f" (plugins add more: entry point group {group!r})")
    return table[name]


def get_loss(name: str) -> LossEntry:
    """The loss ``name``; ``RequestError`` listing the known names when there is none."""
    return _lookup(LOSSES, "loss", "arctic_rl.losses", name)


def get_processor(name: str) -> ProcessorEntry:
    """The processor ``name``; ``RequestError`` listing the known names when there is none."""
    return _lookup(PROCESSORS, "processor", "arctic_rl.processors", name)


def loss_needs(name: str, config: dict[str, Any]) -> set[str]:
    """The optional inputs (``OPTIONAL_INPUTS``) the core must compute for loss ``name`` with ``config``:
    a built-in needs ``"entropy"`` when ``entropy_coef > 0`` and ``"ref_logprobs"`` when ``kl_coef > 0``;
    a registered loss, what it declared. Raises ``RequestError`` for an unknown name or a bad config."""
    entry = get_loss(name)
    if not entry.builtin:
        _check_config_dict(name, config)
        return set(entry.needs)
    _, _, regularizers = builtin_loss_settings(name, config)
    return {need for need, coef in (("entropy", regularizers.entropy_coef), ("ref_logprobs", regularizers.kl_coef)) if coef > 0}


def compute_loss(name: str, inputs: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` of ``inputs`` under ``config``, with its output checked: ``(scalar loss, {stat: scalar})``.

    Raises:
        RequestError: unknown name, bad config, or an input the loss needs is missing.
        ServiceError: the loss returned something else than its contract (a bug in that loss).
    """
    entry = get_loss(name)
    if not entry.builtin:  # a built-in checks its config and inputs itself
        _check_config_dict(name, config)
        provided = {"entropy": inputs.entropy, "ref_logprobs": inputs.ref_logprobs}
        for need in sorted(entry.needs):
            if provided[need] is None:
                raise RequestError(f"loss {name!r} needs {need}, which was not computed" + _HOW_TO_GET[need])
    loss, stats = entry.fn(inputs, config)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ServiceError(f"loss {name!r} returned {_describe(loss)} as its loss; expected a scalar tensor")
    if not isinstance(stats, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in stats.items()):
        raise ServiceError(f"loss {name!r} returned {_describe(stats)} as its stats; expected {{name: tensor}}")
    return loss.reshape(()), stats


def processor_needs(name: str) -> set[str]:
    """The optional inputs the core must compute for processor ``name`` (``RequestError`` if unknown)."""
    return set(get_processor(name).needs)


def run_processor(name: str, ctx: ForwardContext) -> dict[str, torch.Tensor]:
    """Processor ``name``'s outputs for ``ctx``, each checked to be a tensor ``[n, R]`` or ``[n]``.

    Raises:
        RequestError: unknown name, or an input it needs is missing from ``ctx``.
        ServiceError: it returned something else than named ``[n, R]``/``[n]`` tensors (a bug in it).
    """
    entry = get_processor(name)
    if "ref_logprobs" in entry.needs and ctx.ref_logprobs is None:
        raise RequestError(f"processor {name!r} needs ref_logprobs" + _HOW_TO_GET["ref_logprobs"])
    outputs = entry.fn(ctx)
    if not isinstance(outputs, dict):
        raise ServiceError(f"processor {name!r} returned {_describe(outputs)}; expected {{name: tensor}}")
    shape = tuple(ctx.mask.shape)
    for key, value in outputs.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor) or tuple(value.shape) not in (shape, shape[:1]):
            raise ServiceError(f"processor {name!r} returned {key!r}: {_describe(value)}; expected a tensor of shape "
                               f"{list(shape)} or {list(shape[:1])}")
    return outputs


_HOW_TO_GET = {"entropy": "", "ref_logprobs": " (it needs training.reference_model: true)"}


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _check_config_dict(name: str, config: object) -> None:
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise RequestError(f"loss {name!r}: loss config must be an object of named values, got {_describe(config)}")


# ------------------------------------------------------------------ built-ins


# GRPOModule's per-sequence corrections (TRL's names); the whole-batch ones (top_entropy_quantile,
# mask_truncated_completions, num_iterations) are the client's to do: it chooses what a call's batch holds
_CORRECTION_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                    "vllm_importance_sampling_clip_max", "off_policy_mask_threshold")


def _builtin_loss_keys() -> dict[str, Any]:
    hints = {key: hint for key, hint in get_type_hints(LossConfig).items() if key != "loss_type"}
    hints["loss_aggregation"] = LossAggregation | None
    hints.update(get_type_hints(Regularizers))
    hints.update({key: hint for key, hint in get_type_hints(CorrectionConfig).items() if key in _CORRECTION_KEYS})
    return hints


CLIP_RANGES = (("clip_low", 0.0, 1.0), ("clip_high", 0.0, math.inf))  # key, lowest allowed, first refused
BUILTIN_LOSS_KEYS: dict[str, Any] = _builtin_loss_keys()  # config key -> type, for the built-in losses
_REGULARIZER_KEYS = frozenset(f.name for f in fields(Regularizers))


def builtin_loss_settings(name: str, config: dict[str, Any]) -> tuple[LossConfig, LossAggregation, Regularizers]:
    """``grpo_family_loss``'s settings for built-in loss ``name`` from a request's ``config``, whose keys are
    ``LossConfig``'s fields (but ``loss_type``), ``loss_aggregation`` and ``Regularizers``' fields.

    Raises:
        RequestError: naming an unknown key, a value of the wrong type, or a value out of range.
    """
    _check_config_dict(name, config)
    unknown = sorted(set(config) - set(BUILTIN_LOSS_KEYS))
    if unknown:
        raise RequestError(f"loss {name!r}: unknown config key{'s' * (len(unknown) > 1)} {', '.join(unknown)};"
                           f" known: {', '.join(sorted(BUILTIN_LOSS_KEYS))}")
    for key, value in config.items():
        if not _conforms(value, BUILTIN_LOSS_KEYS[key]):
            raise RequestError(f"loss {name!r}: config {key} must be {_hint_text(BUILTIN_LOSS_KEYS[key])}, got {value!r}")
    regularizers = Regularizers(**{key: value for key, value in config.items() if key in _REGULARIZER_KEYS})
    for key, coef in (("kl_coef", regularizers.kl_coef), ("entropy_coef", regularizers.entropy_coef)):
        if coef < 0:
            raise RequestError(f"loss {name!r}: config {key} must be >= 0, got {coef}")
    for key, low, high in CLIP_RANGES:  # the ratio is clipped to [1 - clip_low, 1 + clip_high]: a non-empty range
        if key in config and not low <= config[key] < high:
            raise RequestError(f"loss {name!r}: config {key} must be in [{low:g}, {high:g}), got {config[key]}")
    try:
        loss_config = LossConfig(loss_type=name, **{key: value for key, value in config.items() if key in LossConfig.field_names()})
    except ValueError as e:  # LossConfig's own checks name the key
        raise RequestError(f"loss {name!r}: config {e}") from None
    return loss_config, config.get("loss_aggregation") or LOSS_AGGREGATION[name], regularizers


def _builtin_loss(name: str, inputs: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``grpo_family_loss`` with ``loss_type=name``; entropy enters only when ``entropy_coef > 0`` and the
    reference only when ``kl_coef > 0`` (as in ``GRPOModule``)."""
    loss_config, aggregation, regularizers = builtin_loss_settings(name, config)
    if regularizers.kl_coef > 0 and inputs.ref_logprobs is None:
        raise RequestError(f"loss {name!r}: config kl_coef={regularizers.kl_coef} needs ref_logprobs"
                           + _HOW_TO_GET["ref_logprobs"])
    if regularizers.entropy_coef > 0 and inputs.entropy is None:
        raise RequestError(f"loss {name!r}: config entropy_coef={regularizers.entropy_coef} needs entropy")
    weights, correction_stats = _correction_weights(name, inputs, config)
    loss, stats = grpo_family_loss(
        loss_config, aggregation, regularizers, inputs.logprobs, inputs.old_logprobs, inputs.advantages, inputs.mask,
        inputs.normalizer,
        ref_logprobs=inputs.ref_logprobs if regularizers.kl_coef > 0 else None,
        entropy=inputs.entropy if regularizers.entropy_coef > 0 else None,
        weights=weights,
    )
    return loss, {**stats, **correction_stats}


def _correction_weights(name: str, inputs: LossInputs, config: dict[str, Any]) -> tuple[PolicyWeights | None, dict[str, torch.Tensor]]:
    """The mismatch correction and off-policy mask a built-in loss's ``config`` asks for (``GRPOModule``'s,
    TRL's names), from ``inputs.sampler_logprobs``; and TRL's ``sampling/*`` metrics of the correction."""
    try:
        cfg = CorrectionConfig(**{key: config[key] for key in _CORRECTION_KEYS if key in config})
    except ValueError as e:  # names the key as model.<key>
        raise RequestError(f"loss {name!r}: config {str(e).removeprefix('model.')}") from None
    if not cfg.vllm_importance_sampling_correction and cfg.off_policy_mask_threshold is None:
        return None, {}
    if inputs.sampler_logprobs is None:
        raise RequestError(f"loss {name!r}: config vllm_importance_sampling_correction / off_policy_mask_threshold need"
                           " batch.sampler_logprobs (the engine's log-probs: Samples.flat_logprobs())")
    if not correction_fits_loss(name, cfg.vllm_importance_sampling_correction, cfg.vllm_importance_sampling_mode):
        raise RequestError("loss 'vespo': config vllm_importance_sampling_mode must be token_truncate or token_mask (as in TRL)")
    weights = policy_weights(cfg, inputs.advantages, inputs.logprobs, inputs.old_logprobs, inputs.sampler_logprobs, inputs.mask)
    if not cfg.vllm_importance_sampling_correction:
        return weights, {}
    metrics = sampler_correction_metrics(inputs.old_logprobs, inputs.sampler_logprobs, inputs.mask, weights.importance)
    return weights, {key: torch.tensor(value) for key, value in metrics.items()}


def _conforms(value: object, hint: Any) -> bool:
    """Whether a JSON value fits a ``LossConfig``/``Regularizers`` field type (no coercion; bools are not numbers)."""
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


def _logprobs(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    return {"logprobs": ctx.logprobs}


def _entropy(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    return {"entropy": ctx.entropy}


def _ref_logprobs(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    if ctx.ref_logprobs is None:
        raise RequestError("processor 'ref_logprobs' needs training.reference_model: true")
    return {"ref_logprobs": ctx.ref_logprobs}


LOSSES.update({name: LossEntry(partial(_builtin_loss, name), frozenset(), builtin=True) for name in LOSS_AGGREGATION})
PROCESSORS.update(
    logprobs=ProcessorEntry(_logprobs, frozenset(), builtin=True),
    entropy=ProcessorEntry(_entropy, frozenset(), builtin=True),
    ref_logprobs=ProcessorEntry(_ref_logprobs, frozenset({"ref_logprobs"}), builtin=True),
)

# ------------------------------------------------------------------ plugins


class PluginError(RuntimeError):
    """An installed plugin's entry point failed to import; the message names it and its package."""


def load_plugins() -> list[str]:
    """Import each entry point of the groups ``arctic_rl.losses`` and ``arctic_rl.processors`` not yet
    imported (its module's decorators register its names). Idempotent; returns what this call imported,
    as ``"group:name = module"``.

    Raises:
        PluginError: an entry point failed to import (or registered a name already taken).
    """
    loaded = []
    for group in PLUGIN_GROUPS:
        for point in sorted(entry_points(group=group), key=lambda p: (p.name, p.value)):
            key = f"{group}:{point.name} = {point.value}"
            if key in LOADED_PLUGINS:
                continue
            try:
                point.load()
            except Exception as e:  # noqa: BLE001  (re-raised naming the plugin)
                package = point.dist.name if point.dist is not None else "an unknown package"
                raise PluginError(f"plugin entry point {key} (from {package}) failed to load: {type(e).__name__}: {e}") from e
            LOADED_PLUGINS.add(key)
            loaded.append(key)
    return loaded
