"""The service's side of the registries: its post-forward processors (``register_processor``: a dict, a decorator,
the built-ins) and the service's view of the one loss registry (``loss_registry.py``), whose errors it
turns into ``RequestError`` (the caller's) and ``ServiceError`` (a loss breaking its contract).

A request names a loss or processor; it can only pick a registered name, never an import path (nothing
here imports a string that came from a request). Losses are registered in the training core's registry
(``arctic_rl.loss_registry.register_loss``, re-exported here); processors here. Plugins, which
``load_plugins()`` imports from installed packages' entry points, may add both. A plugin package declares
its modules in its ``pyproject.toml``::

    [project.entry-points."arctic_rl.losses"]
    mine = "my_pkg.losses"          # my_pkg/losses.py runs @register_loss("mine", needs=("entropy",))

    [project.entry-points."arctic_rl.processors"]
    token_surprise = "my_pkg.processors"

and, once installed beside arctic-rl, requests may name ``"mine"`` (and ``fit`` may use it as ``loss_type``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from arctic_rl.errors import ConfigError
import arctic_rl.loss_registry as loss_registry
from arctic_rl.loss_registry import (LOSS_GROUP, LossContractError, LossInputError, PluginError, RegisteredLoss,
                                     check_registration, describe, register_loss)
from arctic_rl.modules.losses import LossInputs, check_shape
from arctic_rl.serve.errors import RequestError, ServiceError

__all__ = ["ForwardContext", "LossInputs", "PluginError", "compute_loss", "get_loss", "load_plugins", "loss_needs",
           "processor_needs", "register_loss", "register_processor", "run_processor"]

PROCESSOR_GROUP = "arctic_rl.processors"
PLUGIN_GROUPS = (LOSS_GROUP, PROCESSOR_GROUP)


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


ProcessorFn = Callable[[ForwardContext], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class ProcessorEntry:
    """A registered processor: its function, the optional inputs it needs, whether it is built in."""

    fn: ProcessorFn
    needs: frozenset[str]
    builtin: bool = False


PROCESSORS: dict[str, ProcessorEntry] = {}


def register_processor(name: str, *, needs: Iterable[str] = (), override: bool = False) -> Callable[[ProcessorFn], ProcessorFn]:
    """Register ``fn(ctx: ForwardContext) -> {output name: tensor [n, R] or [n]}`` under ``name``; the
    arguments are ``register_loss``'s (``needs=("ref_logprobs",)`` when it reads ``ctx.ref_logprobs``)."""
    def decorator(fn: ProcessorFn) -> ProcessorFn:
        PROCESSORS[name] = ProcessorEntry(fn, check_registration(PROCESSORS, "processor", name, needs, override))
        return fn

    return decorator


def get_processor(name: object) -> ProcessorEntry:
    """The processor ``name``; ``RequestError`` listing the known names when there is none."""
    if not isinstance(name, str):
        raise RequestError(f"processor name must be a string, got {type(name).__name__}")
    if name not in PROCESSORS:
        raise RequestError(f"unknown processor {name!r}; known: {', '.join(sorted(PROCESSORS))}"
                           f" (plugins add more: entry point group {PROCESSOR_GROUP!r})")
    return PROCESSORS[name]


def get_loss(name: object) -> RegisteredLoss:
    """The loss ``name`` of the core's registry; ``RequestError`` listing the known names when there is none."""
    with request_errors():
        return loss_registry.get_loss(name)


def loss_needs(name: str, config: dict[str, Any]) -> set[str]:
    """The optional inputs (``entropy``, ``ref_logprobs``) the core must compute for loss ``name`` with ``config``:
    a built-in needs ``"entropy"`` when ``entropy_coef > 0`` and ``"ref_logprobs"`` when ``kl_coef > 0``;
    a registered loss, what it declared. Raises ``RequestError`` for an unknown name or a bad config."""
    with request_errors():
        return loss_registry.loss_needs(name, config)


def compute_loss(name: str, inputs: LossInputs, config: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss ``name`` of ``inputs`` under ``config`` (``loss_registry.compute_loss``), with the service's errors.

    Raises:
        RequestError: unknown name, bad config, or an input the loss needs is missing.
        ServiceError: the loss returned something else than its contract (a bug in that loss).
    """
    with request_errors():
        try:
            return loss_registry.compute_loss(name, inputs, config)
        except LossContractError as e:
            raise ServiceError(str(e)) from None


@contextmanager
def request_errors() -> Iterator[None]:
    """Turn the core's ``ConfigError`` (a bad loss name, config or input) into a ``RequestError``, saying how to
    get a missing input."""
    try:
        yield
    except ConfigError as e:
        need = e.need if isinstance(e, LossInputError) else None
        raise RequestError(str(e) + _HOW_TO_GET.get(need, "")) from None


def _check_shape(name: str, tensor: torch.Tensor, allowed: Iterable[tuple[int, ...]]) -> None:
    with request_errors():
        check_shape(name, tensor, allowed)


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
        raise ServiceError(f"processor {name!r} returned {describe(outputs)}; expected {{name: tensor}}")
    shape = tuple(ctx.mask.shape)
    for key, value in outputs.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor) or tuple(value.shape) not in (shape, shape[:1]):
            raise ServiceError(f"processor {name!r} returned {key!r}: {describe(value)}; expected a tensor of shape "
                               f"{list(shape)} or {list(shape[:1])}")
    return outputs


_HOW_TO_GET = {"entropy": "", "ref_logprobs": " (it needs training.reference_model: true)"}


# ------------------------------------------------------------------ built-in processors


def _logprobs(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    return {"logprobs": ctx.logprobs}


def _entropy(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    return {"entropy": ctx.entropy}


def _ref_logprobs(ctx: ForwardContext) -> dict[str, torch.Tensor]:
    if ctx.ref_logprobs is None:
        raise RequestError("processor 'ref_logprobs' needs training.reference_model: true")
    return {"ref_logprobs": ctx.ref_logprobs}


PROCESSORS.update(
    logprobs=ProcessorEntry(_logprobs, frozenset(), builtin=True),
    entropy=ProcessorEntry(_entropy, frozenset(), builtin=True),
    ref_logprobs=ProcessorEntry(_ref_logprobs, frozenset({"ref_logprobs"}), builtin=True),
)


def load_plugins() -> list[str]:
    """Import each entry point of the groups ``arctic_rl.losses`` and ``arctic_rl.processors`` not yet
    imported (``loss_registry.load_plugins``); returns what this call imported, as ``"group:name = module"``.

    Raises:
        PluginError: an entry point failed to import (or registered a name already taken).
    """
    return loss_registry.load_plugins(PLUGIN_GROUPS)
