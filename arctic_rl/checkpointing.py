"""Activation checkpointing of the policy's decoder layers (``model.init_args.compute.gradient_checkpointing``).

``false``: every activation is kept for backward. ``true`` (or ``"full"``): each decoder layer keeps only its input
and is run again in backward (torch's non-reentrant checkpoint), a fourth pass over every matmul: about a third more
compute. ``"selective"``: each layer is still run again, but the outputs of its linear layers (q/k/v/o, gate/up/down:
the matmuls) and of ZoRRo's cascade attention (``cudnn``, ``flash_varlen``) are kept from the forward and handed back
in the replay, so the replay computes only the cheap elementwise work (norms, activations, RoPE, residual adds,
casts) and any other attention (flex, SDPA: run again). Memory lies between the two; compute is
nearly that of no checkpointing. All three give the same gradients (``tests/modules/test_checkpointing.py``).

How: torch's checkpoint takes a ``context_fn`` whose two contexts wrap the forward and its replay. Ours share one
:class:`_Tape` per checkpointed call: in the forward each ``nn.Linear`` of the model records its output on the
active tape; in the replay it takes that output back, through :class:`_TapedLinear`, whose backward is a linear
layer's (input and weight gradients from the saved input and weight), so the replayed graph is complete. torch's
own selective checkpointing (``create_selective_checkpoint_contexts``) decides per aten operator in a Python
dispatch mode; measured on the H200 (BENCHMARKS) that adds more host time per step than the matmuls it saves, so it
is not used. Linear layers outside a checkpointed layer (the head) see no tape and run as usual; other matmuls
(mixture-of-experts weights held as tensors) are replayed. The cascade keeps its merged output and log-sum-exp, what
its backward reads (:func:`active_tape`). Both modes' recompute routes a mixture-of-experts layer's tokens to the experts
its forward replayed (``router_replay.py``, ``corrections.router_replay``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from arctic_rl.options.sections import checkpointing_mode
from arctic_rl.patches.transformers import override_forward
from arctic_rl.router_replay import checkpoint_contexts

_active = threading.local()  # .tape: the checkpointed call whose forward or replay runs on this thread


class _Tape:
    """The linear outputs of one checkpointed call, in call order: recorded by its forward, taken by its replay."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.replaying = False
        self.next = 0

    def record(self, value: Any) -> None:
        self.outputs.append(value)

    def take(self) -> Any:
        if self.next >= len(self.outputs) or self.outputs[self.next] is None:
            raise RuntimeError("selective checkpointing: the replay of a decoder layer ran a linear layer its forward did "
                               "not (a data-dependent branch), or backward ran twice through it")
        out, self.outputs[self.next] = self.outputs[self.next], None  # freed as the replay goes
        self.next += 1
        return out


@contextlib.contextmanager
def _on(tape: _Tape, replaying: bool) -> Iterator[None]:
    previous = getattr(_active, "tape", None)
    tape.replaying, tape.next = replaying, 0
    _active.tape = tape if (replaying or torch.is_grad_enabled()) else None  # no-grad forwards record nothing
    try:
        yield
    finally:
        _active.tape = previous
        if replaying:  # torch stops a replay once backward has what it needs: what it did not take is freed
            tape.outputs.clear()


def active_tape() -> _Tape | None:
    """The tape of the selective-checkpoint forward (``replaying`` false) or replay (true) running on this thread, if
    any: other kernels that can hand their kept result back in the replay use it too (``zorro/cascade.py``)."""
    return getattr(_active, "tape", None)


def selective_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch checkpoint's ``context_fn``: the forward records on a fresh tape, the replay takes from it; and the
    replay routes a mixture-of-experts layer's tokens as its forward did (:func:`full_contexts`)."""
    tape = _Tape()
    forward, recompute = checkpoint_contexts()
    return _both(_on(tape, replaying=False), forward), _both(_on(tape, replaying=True), recompute)


def full_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch checkpoint's ``context_fn`` of full checkpointing: the recompute replays the router choices its forward
    replayed (``router_replay.checkpoint_contexts``; nothing without router replay)."""
    return checkpoint_contexts()


@contextlib.contextmanager
def _both(first: contextlib.AbstractContextManager, second: contextlib.AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


class _TapedLinear(torch.autograd.Function):
    """``x @ weight.T + bias``, or ``kept`` (the forward's output, in the replay) without the matmul. Forward and replay
    save the same tensors, as torch's checkpoint requires; the backward is the linear layer's."""

    @staticmethod
    def forward(ctx, x, weight, bias, kept):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias) if kept is None else kept.view_as(kept)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight) if need_x else None
        grad_w = (flat.t() @ x.reshape(-1, x.shape[-1])) if need_w else None
        grad_b = flat.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def _selective_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    tape = getattr(_active, "tape", None)
    if tape is None:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    weight, bias = self.weight, self.bias
    if torch.is_autocast_enabled(x.device.type):  # the dtypes F.linear runs in under autocast
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if tape.replaying:
        return _TapedLinear.apply(x, weight, bias, tape.take())
    out = _TapedLinear.apply(x, weight, bias, None)
    tape.record(out.detach())
    return out


def _keep_linear_outputs(model: torch.nn.Module) -> int:
    """Give every ``nn.Linear`` of the model the recording forward; returns how many (weights and names unchanged)."""
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            override_forward(module, _selective_linear_forward)
            count += 1
    return count


def enable_checkpointing(model: torch.nn.Module, setting: Any) -> str:
    """Turn the setting on for a transformers model's decoder layers (non-reentrant); returns the mode."""
    mode = checkpointing_mode(setting)
    if mode == "off":
        return mode
    kwargs: dict[str, Any] = {"use_reentrant": False, "context_fn": full_contexts}
    if mode == "selective":
        _keep_linear_outputs(model)
        kwargs["context_fn"] = selective_contexts
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return mode
