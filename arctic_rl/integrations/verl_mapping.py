"""verl 0.9.1's vocabulary to arctic-rl's and back: an actor config's loss settings as a registered loss and
its ``loss_config``, a verl no-padding ``TensorDict`` as a ``TrainBatch``, per-token outputs as verl's jagged
tensors. Pure functions; verl and tensordict are imported lazily (only ``torch`` at import time).

verl's ``ppo_loss`` (``verl.workers.utils.losses``) with ``policy_loss.loss_mode: vanilla`` is arctic-rl's
clipped surrogate: ``clip_ratio_low``/``clip_ratio_high`` are ``clip_low``/``clip_high``, and verl's dual clip
(``clip_ratio_c``, the loss of a negative-advantage token capped at ``c * |A|``) equals arctic-rl's
``dual_clip = c`` (TRL's ``delta``: the ratio capped at ``c``) whenever ``c > 1 + clip_ratio_high``. verl's
``loss_agg_mode`` picks the normaliser: ``token-mean`` (tokens of the mini-batch) is ``dapo``,
``seq-mean-token-mean`` is ``grpo``. ``use_kl_loss`` adds ``kl_loss_coef`` x verl's ``kl_penalty`` of type
``kl_loss_type`` to the per-token loss (no importance-ratio factor), aggregated as the loss, against the service's
reference model; ``entropy_coeff`` subtracts the entropy aggregated as the loss. A ``loss_mode`` naming a registered
arctic-rl plugin loss runs that loss instead, with the same clip/KL/entropy settings under ``fit``'s loss config
names plus its own keys from ``actor_rollout_ref.actor.arctic_rl.loss_config``. The optimizer section's warmup and
cosine map onto the client's ``optim`` schedule (its length: ``training.total_steps``) (``schedule_settings``). Everything else is refused by name
rather than approximated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from arctic_rl.loss_registry import PLUGIN_HINT, get_loss, is_loss, loss_names
from arctic_rl.serve.batch import TrainBatch

# verl loss_agg_mode -> arctic-rl loss whose normaliser is the same (over one optimizer step's batch)
AGG_MODE_TO_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
# verl kl_loss_type -> arctic-rl kl_estimator with the same definition (verl's k3 is the clamped low_var_kl; its
# "k2+"/"mse+" straight-through is k2 itself; "full" is not implemented in verl 0.9.1)
KL_TYPE_TO_ESTIMATOR = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl",
                        "k3": "low_var_kl", "kl+": "k1+", "k1+": "k1+", "abs+": "abs+", "mse+": "k2", "k2+": "k2",
                        "low_var_kl+": "low_var_kl+", "k3+": "low_var_kl+"}


class UnsupportedVerlSetting(ValueError):
    """A verl setting the arctic-rl backend cannot honour exactly; the message names the config key."""


def loss_settings(actor_config: Any, loss_config: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """``(loss name, loss_config)`` for ``ArcticRLClient.forward_backward`` from a verl ``ActorConfig``.

    ``policy_loss.loss_mode: vanilla`` is the clipped surrogate (``dapo`` or ``grpo`` by ``loss_agg_mode``); a
    ``loss_mode`` naming a registered arctic-rl plugin loss (plugins loaded) runs that loss, with the clip, KL and
    entropy settings mapped below under ``fit``'s names plus its own keys, ``loss_config``
    (``actor_rollout_ref.actor.arctic_rl.loss_config``). Raises ``UnsupportedVerlSetting`` naming
    ``actor_rollout_ref.actor.<key>`` for anything without an exact arctic-rl equivalent (another policy loss,
    aggregation, a KL loss, an entropy bonus, ...)."""
    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    if actor_config.loss_agg_mode not in AGG_MODE_TO_LOSS:
        raise _refuse("loss_agg_mode", actor_config.loss_agg_mode, f"supported: {sorted(AGG_MODE_TO_LOSS)}")
    own = _plugin_config(loss_mode, actor_config.loss_agg_mode, loss_config)
    if actor_config.entropy_coeff < 0:
        raise _refuse("entropy_coeff", actor_config.entropy_coeff, "arctic-rl's entropy_coef is a bonus, >= 0")
    if actor_config.use_kl_loss and actor_config.kl_loss_type not in KL_TYPE_TO_ESTIMATOR:
        raise _refuse("kl_loss_type", actor_config.kl_loss_type, f"supported: {sorted(KL_TYPE_TO_ESTIMATOR)}")
    if actor_config.use_kl_loss and actor_config.kl_loss_coef < 0:
        raise _refuse("kl_loss_coef", actor_config.kl_loss_coef, "arctic-rl's kl_coef is >= 0")
    if actor_config.loss_scale_factor is not None:
        raise _refuse("loss_scale_factor", actor_config.loss_scale_factor, "arctic-rl's normalisers are fixed per loss")
    if actor_config.get("use_prefix_grouper", False):
        raise _refuse("use_prefix_grouper", True, "ZoRRo already computes each group's shared prompt once")
    low, high = actor_config.clip_ratio_low, actor_config.clip_ratio_high
    config: dict[str, Any] = {"clip_low": float(low), "clip_high": float(high)}
    dual = actor_config.clip_ratio_c
    if dual is not None:
        if dual <= 1 + high:
            raise _refuse("clip_ratio_c", dual, f"the dual clip must exceed 1 + clip_ratio_high = {1 + high}")
        config["dual_clip"] = float(dual)
    if actor_config.use_kl_loss:  # verl: loss += kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob), ...)
        config.update(kl_coef=float(actor_config.kl_loss_coef), kl_bias_correction=False,
                      kl_estimator=KL_TYPE_TO_ESTIMATOR[actor_config.kl_loss_type])
    if actor_config.entropy_coeff != 0:  # verl: loss -= entropy_coeff * agg_loss(entropy, loss_agg_mode, ...)
        config.update(entropy_coef=float(actor_config.entropy_coeff), entropy_aggregation="loss")
    if own is None:
        return AGG_MODE_TO_LOSS[actor_config.loss_agg_mode], config
    clash = sorted(set(own) & set(config))
    if clash:
        raise _refuse(f"arctic_rl.loss_config.{clash[0]}", own[clash[0]], "verl's own key sets it (clip_ratio_*, "
                      "kl_loss_*, entropy_coeff); set it there")
    return loss_mode, {**config, **own}


def _refuse(key: str, value: Any, why: str) -> UnsupportedVerlSetting:
    return UnsupportedVerlSetting(f"actor_rollout_ref.actor.{key}={value!r} is not supported by the arctic_rl strategy: {why}")


def _plugin_config(loss_mode: Any, agg_mode: str, loss_config: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``loss_config`` (``{}`` when None) when ``loss_mode`` names a registered arctic-rl plugin loss whose normaliser
    is ``agg_mode``'s; None for ``vanilla`` (which takes no ``loss_config``); ``UnsupportedVerlSetting`` else."""
    if loss_mode == "vanilla":
        if loss_config:
            raise _refuse("arctic_rl.loss_config", dict(loss_config), "it configures a plugin loss_mode; vanilla is "
                          "configured by verl's own keys")
        return None
    plugins = [name for name in loss_names() if not get_loss(name).builtin]
    if not isinstance(loss_mode, str) or not is_loss(loss_mode):
        raise _refuse("policy_loss.loss_mode", loss_mode, f"'vanilla' (PPO/GRPO clipped surrogate) or a registered "
                      f"arctic-rl plugin loss: {plugins}{PLUGIN_HINT}")
    entry = get_loss(loss_mode)
    if entry.builtin:
        raise _refuse("policy_loss.loss_mode", loss_mode, "arctic-rl's built-in losses are chosen by loss_mode 'vanilla' "
                      f"and loss_agg_mode; verl's {loss_mode!r} is not mapped (plugin losses: {plugins})")
    matching = [mode for mode, name in AGG_MODE_TO_LOSS.items() if get_loss(name).aggregation == entry.aggregation]
    if entry.aggregation is not None and agg_mode not in matching:
        raise _refuse("loss_agg_mode", agg_mode, f"loss {loss_mode!r} normalises by {entry.aggregation} "
                      f"({' or '.join(repr(m) for m in matching) or 'no loss_agg_mode mapped here'})")
    own = {} if loss_config is None else loss_config
    if not isinstance(own, Mapping) or not all(isinstance(key, str) for key in own):
        raise _refuse("arctic_rl.loss_config", own, "an object of named values, the plugin loss's own keys")
    return dict(own)


def schedule_settings(optimizer_config: Any) -> dict[str, Any]:
    """The client config's ``training`` schedule fields from verl's actor ``optim`` section, as verl's FSDP engine
    builds its scheduler (``_build_lr_scheduler``): warmup ``lr_warmup_steps``, or when that is <= 0,
    ``int(lr_warmup_steps_ratio * total_training_steps)``; ``constant`` (``get_constant_schedule_with_warmup``) or
    ``cosine`` over ``total_training_steps`` with ``min_lr_ratio`` and ``num_cycles``
    (``get_cosine_schedule_with_warmup``). The engine advances the schedule once per verl training step."""
    def refuse(key: str, value: Any, why: str) -> UnsupportedVerlSetting:
        return UnsupportedVerlSetting(f"actor_rollout_ref.actor.optim.{key}={value!r} is not supported by the arctic_rl "
                                      f"strategy: {why}")

    schedule = optimizer_config.get("lr_scheduler_type", "constant")
    if schedule not in ("constant", "cosine"):
        raise refuse("lr_scheduler_type", schedule, "verl's FSDP engine offers 'constant' and 'cosine'")
    if not optimizer_config.get("zero_indexed_step", True):
        raise refuse("zero_indexed_step", False, "the schedule counts steps from 0")
    total = int(optimizer_config.total_training_steps)
    warmup = optimizer_config.lr_warmup_steps
    if warmup is None or warmup <= 0:
        warmup = int(optimizer_config.lr_warmup_steps_ratio * total)
    warmup = max(int(warmup), 0)
    if schedule == "constant":
        return {"lr_schedule": "constant", "warmup_steps": warmup}
    if total <= 0:
        raise refuse("total_training_steps", total, "the cosine schedule needs its length (verl's trainer sets it)")
    min_lr_ratio = optimizer_config.get("min_lr_ratio", None)
    return {"lr_schedule": "cosine", "warmup_steps": warmup, "total_steps": total,
            "min_lr_ratio": 0.0 if min_lr_ratio is None else float(min_lr_ratio),
            "num_cycles": float(optimizer_config.get("num_cycles", 0.5))}


def sequence_lengths(data) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt lengths, response lengths)`` [N] of a verl batch, from its padded ``attention_mask``
    (left-padded prompts, right-padded responses) as ``no_padding_2_padding`` reads them."""
    attention_mask, width = data["attention_mask"], data["prompts"].shape[1]
    return attention_mask[:, :width].sum(1).long(), attention_mask[:, width:].sum(1).long()


def train_batch_from_verl(data, with_loss_inputs: bool) -> TrainBatch:
    """A verl no-padding batch (``left_right_2_no_padding``: ``input_ids`` jagged, ``prompts``/``responses``/
    ``attention_mask``/``response_mask`` padded) as a ``TrainBatch``. ``with_loss_inputs``: also the per-sequence
    advantages (verl broadcasts an outcome advantage over the response; a row that varies is refused) and
    ``old_log_probs``; ``rollout_log_probs`` become the sampler's log-probs when present."""
    prompt_lens, response_lens = sequence_lengths(data)
    if (prompt_lens < 1).any():
        raise ValueError(f"sample {int((prompt_lens < 1).nonzero()[0])}: empty prompt")
    ids = data["input_ids"]
    rows = ids.unbind() if ids.is_nested else [r[m.bool()] for r, m in zip(ids, data["attention_mask"])]
    response_mask = data["response_mask"].float()
    width = response_mask.shape[1]
    inside = (torch.arange(width)[None, :] < response_lens[:, None]).float()
    if ((response_mask != 0) & (inside == 0)).any():  # multi-turn: tool tokens are 0 inside a response, that is all
        bad = int(((response_mask != 0) & (inside == 0)).any(1).nonzero()[0])
        raise ValueError(f"sample {bad}: response_mask marks tokens past the response's end (attention_mask)")
    prompts, response_ids = [], torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, p, r) in enumerate(zip(rows, prompt_lens.tolist(), response_lens.tolist())):
        if row.numel() != p + r:
            raise ValueError(f"sample {i}: input_ids has {row.numel()} tokens, attention_mask says {p} + {r}")
        prompts.append(row[:p].tolist())
        response_ids[i, :r] = row[p:]
    optional: dict[str, torch.Tensor] = {}
    if "rollout_log_probs" in data.keys():
        optional["sampler_logprobs"] = _padded(data["rollout_log_probs"]) * response_mask
    advantages = None
    if with_loss_inputs and "rollout_is_weights" in data.keys():
        raise UnsupportedVerlSetting("algorithm.rollout_correction: verl's rollout importance weights are not mapped by the "
                                     "arctic_rl strategy; turn the correction off")
    if with_loss_inputs:
        advantages = _outcome_advantages(_padded(data["advantages"]), response_mask)
        optional["old_logprobs"] = _padded(data["old_log_probs"]).float() * response_mask
        if "ref_log_prob" in data.keys():  # verl's ref worker's: the service's reference model's (ArcticRLEngine)
            optional["ref_logprobs"] = _padded(data["ref_log_prob"]).float() * response_mask
    return TrainBatch(prompts, response_ids, response_mask, advantages, **optional)


def _padded(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_padded_tensor(0.0) if tensor.is_nested else tensor


def _outcome_advantages(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[N] from verl's [N, R] token advantages: one value per sequence (GRPO/RLOO/REINFORCE++ outcome
    estimators broadcast it), else an error naming the sample (GAE's per-token advantages need a critic)."""
    advantages = advantages.float()
    counts = response_mask.sum(1).clamp(min=1)
    per_sequence = (advantages * response_mask).sum(1) / counts
    spread = ((advantages - per_sequence[:, None]).abs() * response_mask).amax(1)
    varies = spread > 1e-6 * per_sequence.abs().clamp(min=1)
    if varies.any():
        bad = int(varies.nonzero()[0])
        raise ValueError(f"sample {bad}: advantages vary across its response tokens; the arctic_rl strategy takes "
                         "outcome advantages (algorithm.adv_estimator grpo, rloo, reinforce_plus_plus, ...), not GAE")
    return per_sequence


def to_verl_jagged(per_token: torch.Tensor, data) -> torch.Tensor:
    """arctic-rl's ``[N, R]`` per-response-token outputs as verl's jagged tensor over ``input_ids``: position
    ``t`` holds the value for token ``t + 1`` (so ``no_padding_2_padding`` reads the response back)."""
    prompt_lens, response_lens = sequence_lengths(data)
    rows = []
    for i, (p, r) in enumerate(zip(prompt_lens.tolist(), response_lens.tolist())):
        row = torch.zeros(p + r, dtype=per_token.dtype)
        row[p - 1: p - 1 + r] = per_token[i, :r]
        rows.append(row)
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
