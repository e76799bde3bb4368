"""The output head's logit transform, measured from the model itself and stated once for every head path.

Many families post-process ``lm_head(h)`` before returning logits: Granite divides by
``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 soft-cap with
``final_logit_softcapping``, MuseGlimmer multiplies then caps, ... Rather than a per-family table,
``head_transform(model)`` *measures* the map: one tiny forward of the model's own ``forward`` with
the output head's result replaced by known values ``u`` (a forward hook), reading back the logits
``y`` it returns, and finds which ``y = scale * u`` or ``y = cap * tanh(scale * u / cap)`` explains
them, with ``scale`` 1 or a config value (or its inverse) and ``cap`` a config value. Anything else
(a bias, a per-position change, an unknown factor) raises :class:`UnsupportedLogitTransform`.

At temperature ``T`` the head's log-probs use ``z = c * tanh(u / d)`` (``c > 0``) or ``z = u / d``
(``c == 0``), ``(d, c) = transform.kernel_params(T)``; ``dz/du = c * (1 - tanh(u / d)^2) / d`` or
``1 / d``. ``tempered_logits`` / ``chain_to_head_output_`` here and the Triton kernels in
``head_kernels.py`` are the only places that compute them. (Without a transform ``d = T``: the
plain ``logits / T``, rounded exactly as before.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


class UnsupportedLogitTransform(ValueError):
    """The model post-processes its head's logits in a way arctic-rl does not reproduce."""


@dataclass(frozen=True)
class HeadTransform:
    """``y = scale * u`` (``softcap`` None) or ``y = softcap * tanh(scale * u / softcap)``: the logits
    the model returns, from its output head's result ``u``."""

    scale: float = 1.0
    softcap: float | None = None

    def kernel_params(self, temperature: float) -> tuple[float, float]:
        """``(d, c)``: the tempered logits are ``c * tanh(u / d)`` when ``c > 0``, else ``u / d``."""
        if self.softcap is None:
            return temperature / self.scale, 0.0
        return self.softcap / self.scale, self.softcap / temperature

    def model_logits(self, u: torch.Tensor) -> torch.Tensor:
        """What the model returns for head output ``u`` (the transform at temperature 1)."""
        d, c = self.kernel_params(1.0)
        return c * torch.tanh(u / d) if c else u / d


IDENTITY = HeadTransform()


def tempered_logits(logits: torch.Tensor, d: float, c: float) -> torch.Tensor:
    """A fresh fp32 (fp64 for fp64) tensor ``z`` from head outputs ``logits``, safe to modify in place."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if d != 1.0:
        z.div_(d)
    return z.tanh_().mul_(c) if c else z


def chain_to_head_output_(grad_z: torch.Tensor, logits: torch.Tensor, d: float, c: float) -> torch.Tensor:
    """``grad_z * dz/du`` in place on ``grad_z`` (fp32/fp64, ``[M, V]`` like ``logits``)."""
    if c:
        t = tempered_logits(logits, d, 1.0)  # tanh(u / d)
        grad_z.mul_(t.mul_(t).neg_().add_(1.0).mul_(c))
    return grad_z.div_(d) if d != 1.0 else grad_z


_MEASURED: weakref.WeakKeyDictionary[torch.nn.Module, HeadTransform] = weakref.WeakKeyDictionary()
_SCALE_KEYS, _CAP_KEYS = ("logit", "multiplier", "scal"), ("cap",)
_RTOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def head_transform(model: torch.nn.Module) -> HeadTransform:
    """The transform ``model.forward`` applies to its output head's result, measured once per model
    (one forward of two tokens, no grad; under ZeRO-3 every rank must call it, as every rank runs
    the same log-prob passes). Raises :class:`UnsupportedLogitTransform` when none fits."""
    if model not in _MEASURED:
        _MEASURED[model] = _measure(model)
    return _MEASURED[model]


def _measure(model: torch.nn.Module) -> HeadTransform:
    head = model.get_output_embeddings()
    probe: dict[str, torch.Tensor] = {}

    def replace_output(module, args, output):
        probe["u"] = _probe_values(output, _candidates(model.config)[1])
        return probe["u"]

    device = model.get_input_embeddings().weight.device
    handle = head.register_forward_hook(replace_output)
    try:
        with torch.no_grad():
            y = model(input_ids=torch.tensor([[0, 1]], device=device), use_cache=False).logits
    finally:
        handle.remove()
    model_type = model.config.model_type
    if "u" not in probe or y.shape != probe["u"].shape:
        raise UnsupportedLogitTransform(
            f"model type '{model_type}' ({type(model).__name__}): its forward does not return the output head's "
            "(get_output_embeddings()) result as logits of the same shape; arctic-rl cannot read its log-probs"
        )
    u, y = probe["u"].double(), y.double()
    scales, caps = _candidates(model.config)
    fits = []
    for scale in scales:
        for cap in (None, *caps):
            transform = HeadTransform(scale, cap)
            err = ((y - transform.model_logits(u)).abs() / transform.model_logits(u).abs()).max().item()
            fits.append((err, transform))
    err, best = min(fits, key=lambda f: f[0])
    if err > _RTOL.get(probe["u"].dtype, 3e-2):
        i = int((y - u).abs().flatten().argmax())
        raise UnsupportedLogitTransform(
            f"model type '{model_type}' ({type(model).__name__}) post-processes its output head's logits in a way "
            f"arctic-rl does not reproduce (head output {u.flatten()[i].item():.6g} became logit "
            f"{y.flatten()[i].item():.6g}; no scale by 1 or a config value, with or without a config soft-cap, "
            f"fits within {err:.2g}); its log-probs and gradients would differ from the model's own"
        )
    return best


def _candidates(config) -> tuple[list[float], list[float]]:
    """Scales (1, config values and their inverses) and soft-caps (config values) to try."""
    fields: dict[str, object] = {}
    for cfg in (config, config.get_text_config()):
        fields.update(cfg.to_dict())
    scales, caps = {1.0}, set()
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value == 0:
            continue
        if any(k in key for k in _CAP_KEYS):
            caps.add(abs(float(value)))
        elif any(k in key for k in _SCALE_KEYS):
            scales.update((float(value), 1.0 / float(value)))
    return sorted(scales), sorted(caps)


def _probe_values(like: torch.Tensor, caps: list[float]) -> torch.Tensor:
    """Head outputs shaped like ``like``: +- a geometric sweep from 1e-2 to well past every cap
    (the linear regime fixes the scale, saturation fixes the cap), in ``like``'s dtype."""
    vocab = like.shape[-1]
    top = min(4.0 * max([*caps, 250.0]), 4e3 if like.dtype == torch.float16 else 1e6)
    half = torch.logspace(-2, torch.log10(torch.tensor(top)).item(), (vocab + 1) // 2, dtype=torch.float64)
    row = torch.cat([half, -half])[:vocab]
    return row.to(device=like.device, dtype=like.dtype).expand(like.shape).contiguous()
