"""The output head's logit transform, measured from the model itself and stated once for every head path.

Many families post-process ``lm_head(h)`` before returning logits: Granite divides by
``logits_scaling``, Cohere multiplies by ``logit_scale``, Gemma 2/3 soft-cap with
``final_logit_softcapping``, MuseGlimmer multiplies then caps, MiniCPM3 divides the hidden state
before the head... Rather than a per-family table, ``head_transform(model)`` *measures* the map:
one tiny forward of the model's own ``forward`` with the output head's result replaced by known
values ``u`` (a forward hook), reading back the logits ``y`` it returns, and finds which
``y = scale * u`` or ``y = cap * tanh(scale * u / cap)`` explains them, with ``scale`` 1 or a config
value (or its inverse) and ``cap`` a config value; the head's input is compared with the decoder's
output the same way (a factor there joins ``scale``; the head is linear). Anything else (a bias, a
per-position change, an unknown factor) raises :class:`UnsupportedLogitTransform`.

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
    (a forward and a decoder forward of two tokens, eval mode, no grad; under ZeRO-3 every rank must
    call it, as every rank runs the same log-prob passes). Raises :class:`UnsupportedLogitTransform`
    when none fits."""
    if model not in _MEASURED:
        _MEASURED[model] = _measure(model)
    return _MEASURED[model]


def _measure(model: torch.nn.Module) -> HeadTransform:
    head = model.get_output_embeddings()
    scales, caps = _candidates(model.config)
    probe: dict[str, torch.Tensor] = {}

    def replace_output(module, args, output):
        probe["h"], probe["u"] = args[0], _probe_values(output, caps)
        return probe["u"]

    ids = torch.tensor([[0, 1]], device=model.get_input_embeddings().weight.device)
    handle, was_training = head.register_forward_hook(replace_output), model.training
    model.eval()  # no dropout: the two forwards below must compute the same hidden states
    try:
        with torch.no_grad():
            y = model(input_ids=ids, use_cache=False).logits
            decoded = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    finally:
        handle.remove()
        model.train(was_training)
    if "u" not in probe or y.shape != probe["u"].shape:
        raise _unsupported(model, "its forward does not return the output head's (get_output_embeddings()) "
                                  "result as logits of the same shape")
    pre = _fit_hidden_scale(model, probe["h"], decoded, scales, head)
    rtol = _RTOL.get(probe["u"].dtype, 3e-2)
    u, y = probe["u"].double(), y.double()
    fits = []
    for scale in scales:
        for cap in (None, *caps):
            want = HeadTransform(scale, cap).model_logits(u)
            fits.append((((y - want).abs() / want.abs()).max().item(), HeadTransform(scale * pre, cap)))
    err, best = min(fits, key=lambda f: f[0])
    if err > rtol:
        i = int((y - u).abs().flatten().argmax())
        raise _unsupported(model, f"it post-processes its output head's logits in a way arctic-rl does not reproduce "
                                  f"(head output {u.flatten()[i].item():.6g} became logit {y.flatten()[i].item():.6g}; no "
                                  f"scale by 1 or a config value, with or without a config soft-cap, fits within {err:.2g})")
    return best


def _fit_hidden_scale(model, head_input: torch.Tensor, decoded: torch.Tensor, scales: list[float], head) -> float:
    """The factor ``forward`` applies to the decoder's last hidden state before the head (MiniCPM3
    and Inkling divide it by a config value): 1, or a config value or its inverse."""
    head_input, decoded = head_input.double(), decoded.double()
    if head_input.shape != decoded.shape:
        raise _unsupported(model, "its head does not read the decoder's (get_decoder()) last hidden states")
    size = decoded.abs().max().clamp_min(1e-30)
    err, pre = min(((head_input - f * decoded).abs().max().item() / (f * size).item(), f) for f in scales)
    if err > _RTOL.get(decoded.dtype, 3e-2) * 10:  # relative to the largest entry: two forwards, one rounding
        raise _unsupported(model, f"its forward changes the decoder's last hidden state before the head (no scale "
                                  f"by 1 or a config value fits within {err:.2g})")
    if pre != 1.0 and getattr(head, "bias", None) is not None:
        raise _unsupported(model, f"its forward scales the hidden state by {pre:g} before a head with a bias")
    return pre


def _unsupported(model: torch.nn.Module, what: str) -> UnsupportedLogitTransform:
    return UnsupportedLogitTransform(
        f"model type '{model.config.model_type}' ({type(model).__name__}): {what}; arctic-rl would compute log-probs "
        "and gradients that differ from the model's own"
    )


def _candidates(config) -> tuple[list[float], list[float]]:
    """Scales (1, config values and their inverses) and soft-caps (config values) to try."""
    fields: dict[str, object] = {}
    for cfg in (config, config.get_text_config()):
        fields.update(cfg.to_dict())
        derived = [k for k, v in vars(type(cfg)).items() if isinstance(v, property) and any(s in k for s in _SCALE_KEYS)]
        fields.update({k: getattr(cfg, k) for k in derived})  # e.g. MiniCPM3's logits_scaling property
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
