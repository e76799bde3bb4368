"""The one place that changes a transformers model or modeling module in place: instance ``forward`` overrides
(Liger's kernels, selective checkpointing's recorded linears, router replay's MoE routers) and modeling-module functions wrapped or switched
(ZoRRo's segmented gated DeltaNet kernels, Liger's rotary embedding). Written against transformers 5.17-5.19 and
torch 2.11-2.13; each function names the tests that pin it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch


def override_forward(module: torch.nn.Module, forward: Callable[..., Any]) -> None:
    """Give one module instance its own ``forward`` (``forward(self, ...)``, bound to ``module``); the class, the
    parameters and ``state_dict`` keys are unchanged. torch's ``nn.Module.__call__`` looks ``forward`` up on the
    instance first (torch 2.11-2.13). Pinned by ``tests/modules/test_liger.py`` and
    ``tests/modules/test_checkpointing.py`` and ``tests/test_router_replay.py``."""
    module.forward = types.MethodType(forward, module)


def own_forward(module: torch.nn.Module) -> Callable[..., Any] | None:
    """The function an :func:`override_forward` gave ``module`` (None: it runs its class's ``forward``)."""
    forward = vars(module).get("forward")
    return forward.__func__ if isinstance(forward, types.MethodType) else None


def forward_globals(module: torch.nn.Module) -> dict[str, Any]:
    """The globals of the modeling module in which ``module``'s class ``forward`` looks up the functions it calls
    (e.g. a Llama-style attention's ``apply_rotary_pos_emb``, transformers 5.17-5.19)."""
    import inspect

    return inspect.unwrap(type(module).forward).__globals__


def switch_global(globals_: dict[str, Any], name: str, switch: Callable[[Callable], Callable],
                  installed: type) -> None:
    """Replace the modeling module function ``globals_[name]`` by ``switch(original)`` once: a value already of
    type ``installed`` is left as it is. Used for Liger's rotary embedding (``apply_rotary_pos_emb``, transformers
    5.17-5.19's Llama-style modeling modules). Pinned by ``tests/modules/test_liger.py``."""
    if not isinstance(globals_[name], installed):
        globals_[name] = switch(globals_[name])


def wrap_modeling_function(modeling: types.ModuleType, name: str, wrap: Callable[[Callable], Callable],
                           marker: str) -> None:
    """Replace ``modeling.<name>`` by ``wrap(original)`` unless the current value carries the attribute ``marker``
    (so wrapping twice is a no-op). Used for ZoRRo's segmented gated DeltaNet kernels: ``causal_conv1d_fn`` and
    ``torch_chunk_gated_delta_rule`` of transformers 5.17-5.19's ``modeling_qwen3_next`` and
    ``modeling_qwen3_5``. Pinned by ``tests/zorro/test_linear_attention.py``."""
    current = getattr(modeling, name)
    if not getattr(current, marker, False):
        setattr(modeling, name, wrap(current))
