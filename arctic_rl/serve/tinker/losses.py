"""Tinker's loss functions (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``) as arctic-rl
registered losses named ``tinker.<name>``, so a SkyRL/Tinker ``forward_backward`` keeps Tinker's meaning.

Tinker's losses are token *sums* (no normaliser; its metric is ``loss:sum``), with the ratio taken
against the sampler's log-probs (``loss_fn_inputs["logprobs"]``), which ``batch`` sends as the batch's
``sampler_logprobs``. Per token, over the response mask (``r = exp(logprobs - sampler_logprobs)``, ``A``
per token; the weights folded into it where the loss is linear in it):

- ``importance_sampling``: ``-r * A``
- ``ppo``: ``-min(r * A, clip(r, lo, hi) * A)`` (``clip_low_threshold`` 0.8, ``clip_high_threshold`` 1.2)
- ``cispo``: ``-sg(clip(r, lo, hi)) * logprobs * A``
- ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs)**2)`` (``beta`` required: the SDK
  documents no default)
- ``cross_entropy``: ``-logprobs * A``, where ``batch`` sends each target's weight as ``A``, so it
  is the weighted negative log-likelihood.

Importing this module registers them in the one loss registry (``loss_registry.py``), as a plugin
registers its losses, in the process that runs the training core: the server of ``arctic-rl serve --api
tinker``, or the SkyRL engine's own process (``protocol: local``).
"""

from __future__ import annotations

from typing import Any

import torch

from arctic_rl.serve.errors import RequestError
from arctic_rl.loss_registry import LOSSES, register_loss
from arctic_rl.modules.losses import LossInputs

PREFIX = "tinker."
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}  # SkyRL 0.4's JAX backend defaults


def _sum(per_token: torch.Tensor, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = (per_token * inputs.mask).sum()
    return loss, {"num_loss_tokens": inputs.mask.sum().detach()}


def _advantages(inputs: LossInputs) -> torch.Tensor:
    adv = inputs.advantages
    return adv if adv.dim() == 2 else adv.unsqueeze(-1)


def _ratio(name: str, inputs: LossInputs) -> torch.Tensor:
    if inputs.sampler_logprobs is None:
        raise RequestError(f"loss {name!r} needs batch.sampler_logprobs (Tinker's loss_fn_inputs['logprobs'])")
    return torch.exp(inputs.logprobs - inputs.sampler_logprobs)


def _clip_config(name: str, config: dict[str, Any], allowed: tuple[str, ...]) -> dict[str, float]:
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise RequestError(f"loss {name!r}: unknown config keys {unknown}; known: {list(allowed)}")
    out = {key: float(config.get(key, CLIP_DEFAULTS[key])) for key in CLIP_DEFAULTS}
    if not 0 < out["clip_low_threshold"] <= out["clip_high_threshold"]:
        raise RequestError(f"loss {name!r}: need 0 < clip_low_threshold <= clip_high_threshold, got {out}")
    return out


def _no_config(name: str, config: dict[str, Any]) -> None:
    if config:
        raise RequestError(f"loss {name!r} takes no config, got keys {sorted(config)}")


def importance_sampling(inputs: LossInputs, config: dict[str, Any]):
    _no_config("tinker.importance_sampling", config)
    return _sum(-_ratio("tinker.importance_sampling", inputs) * _advantages(inputs), inputs)


def ppo(inputs: LossInputs, config: dict[str, Any]):
    clip = _clip_config("tinker.ppo", config, ("clip_low_threshold", "clip_high_threshold"))
    ratio, adv = _ratio("tinker.ppo", inputs), _advantages(inputs)
    clipped = ratio.clamp(clip["clip_low_threshold"], clip["clip_high_threshold"])
    return _sum(-torch.minimum(ratio * adv, clipped * adv), inputs)


def cispo(inputs: LossInputs, config: dict[str, Any]):
    clip = _clip_config("tinker.cispo", config, ("clip_low_threshold", "clip_high_threshold"))
    ratio = _ratio("tinker.cispo", inputs).clamp(clip["clip_low_threshold"], clip["clip_high_threshold"])
    return _sum(-ratio.detach() * inputs.logprobs * _advantages(inputs), inputs)


def _beta(name: str, config: dict[str, Any]) -> float:
    unknown = sorted(set(config) - {"beta"})
    if unknown:
        raise RequestError(f"loss {name!r}: unknown config keys {unknown}; known: ['beta']")
    if "beta" not in config:
        raise RequestError(f"loss {name!r} needs loss_fn_config beta (the quadratic penalty's weight; no default)")
    beta = float(config["beta"])
    if not beta >= 0:
        raise RequestError(f"loss {name!r}: beta must be >= 0, got {beta}")
    return beta


def dro(inputs: LossInputs, config: dict[str, Any]):
    beta = _beta("tinker.dro", config)
    if inputs.sampler_logprobs is None:
        raise RequestError("loss 'tinker.dro' needs batch.sampler_logprobs (Tinker's loss_fn_inputs['logprobs'])")
    penalty = (inputs.logprobs - inputs.sampler_logprobs) ** 2
    return _sum(-(inputs.logprobs * _advantages(inputs) - 0.5 * beta * penalty), inputs)


def cross_entropy(inputs: LossInputs, config: dict[str, Any]):
    _no_config("tinker.cross_entropy", config)
    return _sum(-inputs.logprobs * _advantages(inputs), inputs)


def check_config(loss_fn: str, config: dict[str, Any]) -> None:
    """Refuse (``RequestError``) a ``loss_fn_config`` that Tinker's ``loss_fn`` does not take, before any work."""
    if loss_fn in ("ppo", "cispo"):
        _clip_config(f"tinker.{loss_fn}", config, ("clip_low_threshold", "clip_high_threshold"))
    elif loss_fn == "dro":
        _beta("tinker.dro", config)
    else:
        _no_config(f"tinker.{loss_fn}", config)


def datum_loss(loss_fn: str, logprobs, d, config: dict[str, Any]) -> float:
    """Tinker's loss of one datum from its targets' log-probs ``[n]`` (``forward``: no backward), as the SDK's
    documentation defines it, each target weighted by ``d.weights`` (``batch.Datum``)."""
    lp, w = torch.as_tensor(logprobs, dtype=torch.float64), torch.tensor(d.weights, dtype=torch.float64)
    if loss_fn == "cross_entropy":
        _no_config("tinker.cross_entropy", config)
        return float(-(w * lp).sum())
    adv, sampler = torch.tensor(d.advantages, dtype=torch.float64), torch.tensor(d.logprobs, dtype=torch.float64)
    if adv.shape != lp.shape or sampler.shape != lp.shape:
        raise RequestError(f"loss {loss_fn!r} needs loss_fn_inputs advantages and logprobs, one per target")
    if loss_fn == "dro":
        return float(-(w * (lp * adv - 0.5 * _beta("tinker.dro", config) * (lp - sampler) ** 2)).sum())
    ratio = torch.exp(lp - sampler)
    if loss_fn == "importance_sampling":
        _no_config("tinker.importance_sampling", config)
        return float(-(w * ratio * adv).sum())
    clip = _clip_config(f"tinker.{loss_fn}", config, ("clip_low_threshold", "clip_high_threshold"))
    clipped = ratio.clamp(clip["clip_low_threshold"], clip["clip_high_threshold"])
    if loss_fn == "ppo":
        return float(-(w * torch.minimum(ratio * adv, clipped * adv)).sum())
    if loss_fn == "cispo":
        return float(-(w * clipped * lp * adv).sum())
    raise RequestError(f"loss {loss_fn!r} is not one of Tinker's losses arctic-rl serves: {sorted(TINKER_LOSSES)}")


TINKER_LOSSES = {"importance_sampling": importance_sampling, "ppo": ppo, "cispo": cispo, "dro": dro, "cross_entropy": cross_entropy}

for _name, _fn in TINKER_LOSSES.items():
    if PREFIX + _name not in LOSSES:  # importing twice (a reload) keeps the first registration
        register_loss(PREFIX + _name)(_fn)
