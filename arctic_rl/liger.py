"""Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE) put into an already-built transformers model, only
where a module computes exactly what the kernel computes; parameters, their names and our fused head stay.

``model.compute.liger`` (``auto | true | false``) on ``GRPOModule``. A module is given a kernel when its code *is*
the computation the kernel reproduces, read from the model itself rather than from a per-family table: the
kernels reproduce transformers' Llama modules (Liger's ``casting_mode="llama"`` RMSNorm with offset 0, its
SwiGLU, its rotate-half RoPE), so a module qualifies when its ``forward`` (or the ``apply_rotary_pos_emb``
its attention calls) compiles to the same bytecode as Llama's, and, for an MLP, its activation is SiLU.
Qwen3, Qwen2, Mistral, Llama and Granite qualify in full; OLMo2's norm (scaled in fp32), the Gemmas' norms
(``1 + w``) and GELU MLPs, Phi3's fused MLP and partial RoPE do not and keep their own code, as do MoE experts.

How each kernel goes in, per instance (other models in the process are untouched):
- RMSNorm and MLP: the module gets an instance ``forward`` calling Liger on its own parameters.
- RoPE: transformers' attention calls its modeling module's global ``apply_rotary_pos_emb``; that global is
  replaced once by :class:`RopeSwitch`, which calls the original except inside the ``forward`` of an
  attention module given Liger (a context variable, so recomputation under gradient checkpointing, which
  re-enters that ``forward``, takes the same path). Written for transformers 5.17-5.19.
Inputs not on CUDA run the module's own code (Liger's kernels are Triton, CUDA only).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.options.sections import LigerSetting
from arctic_rl.patches.transformers import forward_globals, override_forward, own_forward, switch_global


@functools.cache
def liger_installed() -> bool:
    """Whether liger-kernel's kernels can be imported (the package and Triton)."""
    try:
        import liger_kernel.functional  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_liger(setting: LigerSetting) -> bool:
    """``model.compute.liger`` as a decision: ``auto`` is on when CUDA is available and liger-kernel installed;
    ``true`` where either is missing is a :class:`ConfigError` naming the field (raised before any model)."""
    if setting == "auto" and not isinstance(setting, bool):
        return torch.cuda.is_available() and liger_installed()  # CUDA first: no import attempt on CPU machines
    if not isinstance(setting, bool):
        raise ConfigError(f"model.compute.liger must be auto, true or false, got {setting!r}")
    if setting and not torch.cuda.is_available():
        raise ConfigError("model.compute.liger: true runs Liger's Triton kernels, which need a CUDA device, and none is "
                          "available; use liger: auto (off here) or false")
    if setting and not liger_installed():
        raise ConfigError("model.compute.liger: true needs the liger-kernel package (pip install 'arctic-rl[liger]'), which "
                          "is not importable; use liger: auto (off without it) or false")
    return setting


@dataclass(frozen=True)
class LigerOps:
    """The three kernels, as functions of tensors; ``runs_on(x)`` says whether they take ``x``."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps), Llama casting
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # silu(gate) * up
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (q, k, cos, sin) -> rotated (q, k)
    runs_on: Callable[[torch.Tensor], bool]


def liger_ops() -> LigerOps:
    """liger-kernel's functional kernels (its dispatcher picks the implementation for the GPU)."""
    from liger_kernel import functional as liger

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # in_place=False: the gradient is not written into the incoming gradient's storage, which autograd may share
        return liger.rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)

    return LigerOps(rms_norm=rms_norm, swiglu=liger.swiglu, rope=liger.rope, runs_on=lambda x: x.is_cuda)


@dataclass(frozen=True)
class LigerPlan:
    """Which modules of a model get which kernel (dotted module names, as in ``named_modules``)."""

    rms_norm: tuple[str, ...]
    swiglu: tuple[str, ...]
    rope: tuple[str, ...]  # attention modules whose rotary embedding runs on Liger's kernel

    def summary(self) -> str:
        return f"{len(self.rms_norm)} RMSNorm, {len(self.swiglu)} SwiGLU MLP, {len(self.rope)} attention RoPE"


_ACTIVE_OPS: contextvars.ContextVar[LigerOps | None] = contextvars.ContextVar("arctic_rl_liger_rope", default=None)


class RopeSwitch:
    """Stands in for a modeling module's ``apply_rotary_pos_emb``: ``original`` everywhere, except inside the
    forward of an attention module given Liger, on a full-width rotation of tensors its kernels take."""

    def __init__(self, original: Callable) -> None:
        self.original = original

    def __call__(self, q, k, cos, sin, *args: Any, **kwargs: Any):
        ops = _ACTIVE_OPS.get()
        if ops is None or args or kwargs or not ops.runs_on(q) or q.dim() != 4 or cos.shape[-1] != q.shape[-1]:
            return self.original(q, k, cos, sin, *args, **kwargs)
        return ops.rope(q, k, cos, sin)


def _code(fn: Callable) -> tuple | None:
    """What a function computes, without its name, docstring or line numbers (None: not Python code)."""
    fn = inspect.unwrap(fn.original if isinstance(fn, RopeSwitch) else fn)
    code = getattr(fn, "__code__", None)  # torch / transformers callables: builtins and wrappers have none
    if code is None:
        return None
    consts = code.co_consts[1:] if fn.__doc__ is not None and code.co_consts[:1] == (fn.__doc__,) else code.co_consts
    return code.co_code, code.co_names, code.co_varnames, consts


def _reference_codes() -> dict[str, tuple]:
    """The code of the transformers modules Liger's kernels reproduce (Llama's)."""
    from transformers.models.llama import modeling_llama as llama

    return {"rms_norm": _code(llama.LlamaRMSNorm.forward), "mlp": _code(llama.LlamaMLP.forward),
            "rope": _code(llama.apply_rotary_pos_emb)}


def _is_silu(act: Any) -> bool:
    """``act`` computes SiLU (checked on probe values: activation modules have no parameters)."""
    if not isinstance(act, torch.nn.Module) or any(True for _ in act.parameters()):
        return False
    probe = torch.linspace(-8.0, 8.0, 33, device="cpu")  # not the default device of a build context (cuda, meta)
    return torch.equal(act(probe), torch.nn.functional.silu(probe))


def _rope_globals(module: torch.nn.Module, reference: tuple) -> dict[str, Any] | None:
    """The globals (its modeling module's) in which ``module``'s forward looks up the ``apply_rotary_pos_emb``
    it calls, when that function is Llama's; else None."""
    forward = inspect.unwrap(type(module).forward)
    code = getattr(forward, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None
    modeling = forward_globals(module)
    rope = modeling.get("apply_rotary_pos_emb")
    return modeling if rope is not None and _code(rope) == reference else None


def plan_liger(model: torch.nn.Module) -> LigerPlan:
    """The modules of ``model`` that compute exactly what a Liger kernel computes (nothing is changed).
    A module that already has its own instance ``forward`` (patched by someone) is left out."""
    ref = _reference_codes()
    norms, mlps, ropes = [], [], []
    for name, module in model.named_modules():
        if "forward" in vars(module):
            continue
        forward = _code(type(module).forward)
        if forward is None:
            continue
        if forward == ref["rms_norm"]:
            norms.append(name)
        elif forward == ref["mlp"] and _is_silu(module.act_fn):
            mlps.append(name)
        elif _rope_globals(module, ref["rope"]) is not None:
            ropes.append(name)
    return LigerPlan(tuple(norms), tuple(mlps), tuple(ropes))


def apply_liger(model: torch.nn.Module, ops: LigerOps | None = None) -> LigerPlan:
    """Give ``model``'s qualifying modules (:func:`plan_liger`) Liger's kernels, in place; parameters and
    ``state_dict`` keys are unchanged. ``ops``: the kernels (default: liger-kernel's). Returns the plan."""
    ops = ops or liger_ops()
    plan, modules, ref = plan_liger(model), dict(model.named_modules()), _reference_codes()
    for name in plan.rms_norm:
        override_forward(modules[name], _norm_forward(ops, type(modules[name]).forward))
    for name in plan.swiglu:
        override_forward(modules[name], _mlp_forward(ops, type(modules[name]).forward))
    for name in plan.rope:
        modeling = _rope_globals(modules[name], ref["rope"])
        switch_global(modeling, "apply_rotary_pos_emb", RopeSwitch, installed=RopeSwitch)  # once per modeling module
        override_forward(modules[name], _attention_forward(ops, type(modules[name]).forward))
    return plan


def has_liger(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs one of the Liger forwards :func:`apply_liger` gives."""
    forward = own_forward(module)
    return forward is not None and forward.__module__ == __name__


def _norm_forward(ops: LigerOps, own: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not ops.runs_on(hidden_states):
            return own(self, hidden_states)
        out = ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)  # the module's own output dtype
        return out if out.dtype == dtype else out.to(dtype)

    return forward


def _mlp_forward(ops: LigerOps, own: Callable) -> Callable:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not ops.runs_on(x):
            return own(self, x)
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))

    return forward


def _attention_forward(ops: LigerOps, own: Callable) -> Callable:
    def forward(self, *args: Any, **kwargs: Any):
        token = _ACTIVE_OPS.set(ops)  # RopeSwitch reads it in this forward (and its recomputation)
        try:
            return own(self, *args, **kwargs)
        finally:
            _ACTIVE_OPS.reset(token)

    return forward


def use_liger(setting: LigerSetting, *models: torch.nn.Module | None) -> LigerPlan | None:
    """``apply_liger`` to each model given (None: skipped) when ``setting`` resolves on; logs the plan.
    Returns the first model's plan, or None when off."""
    if not resolve_liger(setting):
        return None
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    ops = liger_ops()
    plans = [apply_liger(m, ops) for m in models if m is not None]
    rank_zero_info(f"arctic-rl: Liger kernels on: {plans[0].summary()} (liger: {setting})")
    return plans[0]
