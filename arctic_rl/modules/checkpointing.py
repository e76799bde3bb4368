"""Activation checkpointing of the policy's decoder layers (``model.init_args.compute.gradient_checkpointing``).

``false``: every activation is kept for backward. ``true`` (or ``"full"``): each decoder layer keeps only its input
and is run again in backward, a fourth pass over every matmul (about a third more compute). ``"selective"``: each
layer is still run again, but the outputs of its matmuls and attention kernels are kept from the forward and handed
back in the replay, so the replay computes only the cheap elementwise work (norms, activations, RoPE, residual adds,
casts). Memory lies between the two; compute is nearly that of no checkpointing. All three give the same gradients.

Selective checkpointing is torch's own (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with a
policy over the aten operators: :func:`keeps_output` is the list. Cascade attention (``cudnn``, ``flash_varlen``)
merges its kernels' outputs in place, so those kernels are replayed rather than kept (torch refuses a kept output
that was changed). Linear-attention layers of hybrid models keep their own chunked kernels' rules (replayed).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch

from arctic_rl.errors import ConfigError

GradientCheckpointing = bool | Literal["full", "selective"]
CHECKPOINTING_VALUES = (False, True, "full", "selective")


def checkpointing_mode(setting: Any) -> str:
    """``"off"``, ``"full"`` or ``"selective"`` for a ``gradient_checkpointing`` value; a clear error otherwise."""
    if setting is False or setting is None:
        return "off"
    if setting is True or setting == "full":
        return "full"
    if setting == "selective":
        return "selective"
    raise ConfigError(f"model.compute.gradient_checkpointing must be false, true, 'full' or 'selective', got {setting!r}")


@functools.cache
def _kept_ops() -> frozenset:
    """The aten operators whose outputs selective checkpointing keeps: matmuls, and attention kernels whose
    outputs nothing changes afterwards (not the cascade's cuDNN / FlashAttention varlen kernels: merged in place)."""
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    higher = torch.ops.higher_order
    for name in ("flex_attention", "inductor_compiled_code"):  # compiled FlexAttention: one opaque op
        if hasattr(higher, name):
            ops.add(getattr(higher, name))
    return frozenset(ops)


def keeps_output(func: Any) -> bool:
    """Whether selective checkpointing keeps this operator's output for backward (else it is replayed)."""
    return func in _kept_ops()


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if keeps_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """A fresh pair of torch's selective-checkpoint contexts with the policy above (one per checkpointed call)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_policy)


def enable_checkpointing(model: torch.nn.Module, setting: Any) -> str:
    """Turn the setting on for a transformers model's decoder layers (non-reentrant); returns the mode."""
    mode = checkpointing_mode(setting)
    if mode == "off":
        return mode
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_contexts
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return mode
