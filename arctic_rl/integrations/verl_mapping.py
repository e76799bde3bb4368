"""verl 0.9.1's vocabulary to arctic-rl's and back: an actor config's loss settings as a registered loss and
its ``loss_config``, a verl no-padding ``TensorDict`` as a ``TrainBatch``, per-token outputs as verl's jagged
tensors. Pure functions; verl and tensordict are imported lazily (only ``torch`` at import time).

verl's ``ppo_loss`` (``verl.workers.utils.losses``) with ``policy_loss.loss_mode: vanilla`` is arctic-rl's
clipped surrogate: ``clip_ratio_low``/``clip_ratio_high`` are ``clip_low``/``clip_high``, and verl's dual clip
(``clip_ratio_c``, the loss of a negative-advantage token capped at ``c * |A|``) equals arctic-rl's
``dual_clip = c`` (TRL's ``delta``: the ratio capped at ``c``) whenever ``c > 1 + clip_ratio_high``. verl's
``loss_agg_mode`` picks the normaliser: ``token-mean`` (tokens of the mini-batch) is ``dapo``,
``seq-mean-token-mean`` is ``grpo``. Everything else is refused by name rather than approximated.
"""

from __future__ import annotations

from typing import Any

import torch

from arctic_rl.serve.batch import TrainBatch

# verl loss_agg_mode -> arctic-rl loss whose normaliser is the same (over one optimizer step's batch)
AGG_MODE_TO_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}


class UnsupportedVerlSetting(ValueError):
    """A verl setting the arctic-rl backend cannot honour exactly; the message names the config key."""


def loss_settings(actor_config: Any) -> tuple[str, dict[str, Any]]:
    """``(loss name, loss_config)`` for ``ArcticRLClient.forward_backward`` from a verl ``ActorConfig``.

    Raises ``UnsupportedVerlSetting`` naming ``actor_rollout_ref.actor.<key>`` for anything without an
    exact arctic-rl equivalent (another policy loss, aggregation, a KL loss, an entropy bonus, ...)."""
    def refuse(key: str, value: Any, why: str) -> UnsupportedVerlSetting:
        return UnsupportedVerlSetting(f"actor_rollout_ref.actor.{key}={value!r} is not supported by the arctic_rl "
                                      f"strategy: {why}")

    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    if loss_mode != "vanilla":
        raise refuse("policy_loss.loss_mode", loss_mode, "only 'vanilla' (PPO/GRPO clipped surrogate) is mapped")
    if actor_config.loss_agg_mode not in AGG_MODE_TO_LOSS:
        raise refuse("loss_agg_mode", actor_config.loss_agg_mode, f"supported: {sorted(AGG_MODE_TO_LOSS)}")
    if actor_config.use_kl_loss:
        raise refuse("use_kl_loss", True, "verl's KL losses (clamped low_var_kl, ...) differ from arctic-rl's k3 "
                                          "with bias correction; use algorithm.use_kl_in_reward or kl_loss off")
    if actor_config.entropy_coeff != 0:
        raise refuse("entropy_coeff", actor_config.entropy_coeff, "the entropy bonus is not mapped; set 0")
    if actor_config.loss_scale_factor is not None:
        raise refuse("loss_scale_factor", actor_config.loss_scale_factor, "arctic-rl's normalisers are fixed per loss")
    if actor_config.get("use_prefix_grouper", False):
        raise refuse("use_prefix_grouper", True, "ZoRRo already computes each group's shared prompt once")
    low, high = actor_config.clip_ratio_low, actor_config.clip_ratio_high
    config: dict[str, Any] = {"clip_low": float(low), "clip_high": float(high)}
    dual = actor_config.clip_ratio_c
    if dual is not None:
        if dual <= 1 + high:
            raise refuse("clip_ratio_c", dual, f"the dual clip must exceed 1 + clip_ratio_high = {1 + high}")
        config["dual_clip"] = float(dual)
    return AGG_MODE_TO_LOSS[actor_config.loss_agg_mode], config


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
