"""The one loss registry of arctic-rl: a table of losses by name, filled by ``register_loss`` (the built-ins of
``builtin_losses.py``, the ``tinker.*`` losses of ``serve/tinker/losses.py``, user code, plugins' entry points) and
read by ``fit`` (``model.init_args.loss.loss_type``), the service (a ``forward_backward``'s loss name) and the TRL,
verl and SkyRL adapters alike (``GRPOConfig.loss_type``, ``policy_loss.loss_mode``, the SkyRL backend's ``loss_fns``). A leaf below the training core, beside the ``options`` package (whose ``LossConfig`` checks its
``loss_type`` here): it imports the built-ins' module by name on the first look-up, as it imports a plugin's, and
torch only where a loss runs.

A loss is ``fn(inputs: LossInputs, config: Mapping[str, Any]) -> (loss, stats)``: ``loss`` a scalar tensor
normalised by ``inputs.normalizer`` (micro-batch losses sum to the batch loss), ``stats`` scalar tensors to log.
``config`` is the loss's options: in ``fit``, the fields of the ``loss`` and ``regularizers`` sections (but
``loss_type``); in the service, the request's ``loss_config`` as sent. A name is only ever looked up in this
table, never imported from a string. A plugin package declares the module that registers its losses::

    [project.entry-points."arctic_rl.losses"]
    mine = "my_pkg.losses"          # my_pkg/losses.py runs @register_loss("mine", needs=("entropy",))

and, once installed beside arctic-rl, ``loss_type: mine`` works in ``fit`` and requests may name ``"mine"``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Literal, get_args

from arctic_rl.errors import ConfigError

if TYPE_CHECKING:
    import torch

OPTIONAL_INPUTS = ("entropy", "ref_logprobs")  # what a loss may ask the trainer to compute
LOSS_GROUP = "arctic_rl.losses"  # the entry point group of plugin losses
BUILTIN_MODULES = ("arctic_rl.modules.builtin_losses",)  # imported on the first look-up, as a plugin's module is
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
LossAggregation = Literal["token_mean", "sequence_mean", "sequence_sum", "constant"]  # what a loss normalises by


class LossInputError(ConfigError):
    """A loss's inputs are malformed (a shape) or miss one it needs; ``need`` names a missing optional input."""

    def __init__(self, message: str, need: str | None = None) -> None:
        super().__init__(message)
        self.need = need


class LossContractError(RuntimeError):
    """A loss returned something else than ``(scalar tensor, {name: tensor})``: a bug in that loss."""


class PluginError(RuntimeError):
    """An installed plugin's entry point failed to import; the message names it and its package."""


LossFn = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]  # (inputs: losses.LossInputs, config: Mapping)
NeedsFn = Callable[[Mapping[str, Any]], set[str]]


@dataclass(frozen=True)
class RegisteredLoss:
    """A registered loss: its function, the optional inputs it needs (names, or a function of its config giving
    them, which also checks the config), its normaliser, and whether it is built in (never replaced)."""

    fn: LossFn
    needs: frozenset[str] | NeedsFn = field(default=frozenset())
    aggregation: LossAggregation | None = None  # what it normalises by; None: its own business
    builtin: bool = False

    def needs_for(self, config: Mapping[str, Any]) -> set[str]:
        """The optional inputs (``OPTIONAL_INPUTS``) this loss needs under ``config``."""
        return set(self.needs) if isinstance(self.needs, frozenset) else set(self.needs(config))


LOSSES: dict[str, RegisteredLoss] = {}
LOADED_PLUGINS: set[str] = set()  # "group:name = value" of the entry points imported so far


def check_registration(table: Mapping[str, Any], kind: str, name: str, needs: Iterable[str], override: bool) -> frozenset[str]:
    """``needs`` as a frozenset, after checking ``name`` may be registered in ``table`` (``ValueError`` naming why)."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
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


def register_loss(name: str, *, needs: Iterable[str] | NeedsFn = (), aggregation: LossAggregation | None = None,
                  override: bool = False, builtin: bool = False) -> Callable[[LossFn], LossFn]:
    """Register ``fn(inputs: LossInputs, config) -> (loss, stats)`` under ``name`` (the module docstring says
    what each is); ``loss.loss_type: <name>`` in ``fit`` and a request's loss name then choose it.

    Args:
        name: what configs and requests call it (letters, digits, ``_.-``).
        needs: optional inputs the trainer must compute for it: ``"entropy"``, ``"ref_logprobs"``; or a function
            of the loss's config returning them (raising ``ConfigError`` naming a bad key).
        aggregation: its normaliser (``token_mean``, ``sequence_mean``, ``sequence_sum``, ``constant``), for
            callers that report or reuse it; None when the loss normalises its own way.
        override: replace an earlier registration of ``name`` (built-in names are never replaced).
        builtin: arctic-rl's own losses only: never replaced.

    Raises:
        ValueError: a bad name, an unknown need or aggregation, or ``name`` taken.
    """
    if aggregation is not None and aggregation not in get_args(LossAggregation):
        raise ValueError(f"loss {name!r}: aggregation must be one of {', '.join(get_args(LossAggregation))} or None,"
                         f" got {aggregation!r}")

    def decorator(fn: LossFn) -> LossFn:
        if not builtin:
            load_builtins()  # so that no other registration takes a built-in's name first
        names = frozenset() if callable(needs) else needs
        checked = check_registration(LOSSES, "loss", name, names, override)
        LOSSES[name] = RegisteredLoss(fn, needs if callable(needs) else checked, aggregation, builtin)
        return fn

    return decorator


def get_loss(name: object) -> RegisteredLoss:
    """The loss ``name``, loading plugins first when it is not registered yet.

    Raises:
        ConfigError: ``name`` is not a string, or no loss has it; the message lists the known names.
        PluginError: a plugin failed to import.
    """
    if not isinstance(name, str):
        raise ConfigError(f"loss name must be a string, got {type(name).__name__}")
    if name not in LOSSES:
        load_plugins()
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}{PLUGIN_HINT}")
    return LOSSES[name]


PLUGIN_HINT = f" (plugins add more: entry point group {LOSS_GROUP!r})"


def check_config_dict(name: str, config: object) -> None:
    """A loss config is a mapping of named values (``ConfigError`` naming loss ``name`` otherwise)."""
    if not isinstance(config, Mapping) or not all(isinstance(key, str) for key in config):
        raise ConfigError(f"loss {name!r}: loss config must be an object of named values, got {describe(config)}")


def loss_needs(name: str, config: Mapping[str, Any]) -> set[str]:
    """The optional inputs loss ``name`` needs under ``config`` (``ConfigError``: unknown name or bad config)."""
    entry = get_loss(name)
    check_config_dict(name, config)
    return entry.needs_for(config)


def compute_loss(name: str, inputs: Any, config: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` of ``inputs`` (a ``losses.LossInputs``) under ``config``, with its output checked: ``(scalar loss, {stat: scalar})``.

    Raises:
        ConfigError: unknown name or bad config; ``LossInputError`` (one) when an input it needs is missing.
        LossContractError: the loss returned something else than its contract says (a bug in that loss).
    """
    import torch  # here, not at import: the options package checks loss names through this module

    entry = get_loss(name)
    check_config_dict(name, config)
    if not entry.builtin:  # a built-in checks its config and inputs itself
        provided = {"entropy": inputs.entropy, "ref_logprobs": inputs.ref_logprobs}
        for need in sorted(entry.needs_for(config)):
            if provided[need] is None:
                raise LossInputError(f"loss {name!r} needs {need}, which was not computed", need)
    loss, stats = entry.fn(inputs, config)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise LossContractError(f"loss {name!r} returned {describe(loss)} as its loss; expected a scalar tensor")
    if not isinstance(stats, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in stats.items()):
        raise LossContractError(f"loss {name!r} returned {describe(stats)} as its stats; expected {{name: tensor}}")
    return loss.reshape(()), stats


def describe(value: object) -> str:
    """``a tensor of shape [..]`` or ``a <type>``, for error messages about what a function returned."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def load_builtins() -> None:
    """Import the built-in losses' modules (``BUILTIN_MODULES``): they register theirs the way a plugin's module
    does. Python imports a module once, so this costs nothing after the first call."""
    for module in BUILTIN_MODULES:
        import_module(module)


def load_plugins(groups: Iterable[str] = (LOSS_GROUP,)) -> list[str]:
    """Import the built-in losses' modules (``BUILTIN_MODULES``), then each entry point of ``groups`` not yet
    imported (its module's decorators register its names). Idempotent; returns the entry points this call
    imported, as ``"group:name = module"``.

    Raises:
        PluginError: an entry point failed to import (or registered a name already taken).
    """
    load_builtins()
    loaded = []
    for group in groups:
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


def is_loss(name: object) -> bool:
    """Whether ``name`` is a registered loss (plugins loaded when it is not registered yet)."""
    if name not in LOSSES:
        load_plugins()
    return name in LOSSES


def loss_names() -> list[str]:
    """The registered losses' names, plugins loaded, sorted."""
    load_plugins()
    return sorted(LOSSES)

