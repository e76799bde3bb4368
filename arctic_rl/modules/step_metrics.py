"""Combining and logging a training step's stats: per-micro-batch stats become weighted means, or minima /
maxima for the stats named so (TRL's ``clip_ratio/low_min``, ``clip_ratio/high_max``); :func:`log_step` logs them,
combined over the training ranks (:func:`over_ranks`)."""

from __future__ import annotations

import math
from typing import Any


# maxima not named so: the largest staleness of a step's trained tokens, the most env.step threads an episode left
# running, the most rounds a rank's dynamic sampling took
MAXIMA = ("rollout/staleness", "multi_turn/abandoned_steps", "dynamic_sampling/rounds")
# each rank's is its share of the step's loss (the loss normalisers count every rank's tokens), or a count over its own
# share of the batch (each rank samples, filters and buffers its own groups and episodes)
SUMMED = (
    "loss",
    "agent/divergences", "agent/split_segments",
    "multi_turn/fault_error", "multi_turn/fault_timeout", "multi_turn/fault_observation_budget", "multi_turn/fault_bad_output",
    "dynamic_sampling/dropped_groups", "dynamic_sampling/padded_groups",
    "stream/buffered_groups", "stream/in_flight_groups", "stream/regenerated_groups", "stream/dropped_groups",
)


def is_extreme(key: str) -> bool:
    """Whether stat ``key`` is a minimum or maximum (combined by min/max, not averaged)."""
    return key.endswith(("_min", "/min", "_max", "/max")) or key in MAXIMA


def accumulate(sums: dict[str, float], values: dict[str, Any], weight: float) -> None:
    """``sums[key] += weight * value`` for each entry (weighted means over micro/mini-batches); a minimum
    or maximum (``is_extreme``) keeps the smallest / largest value instead, NaN meaning "none"."""
    for key, value in values.items():
        value = float(value)
        if not is_extreme(key):
            sums[key] = sums.get(key, 0.0) + value * weight
            continue
        pick = min if key.endswith(("_min", "/min")) else max
        old = sums.get(key, math.nan)
        sums[key] = value if math.isnan(old) else old if math.isnan(value) else pick(old, value)


def log_step(module, rollout, rollout_metrics: dict[str, float], sums: dict[str, float], train_s: float) -> None:
    """Log a ``GRPOModule`` training step: the rollout's and the update's metrics, timing, throughput, the
    learning rate, ZoRRo's dedup stats, the reward (over every rank) and the epoch means."""
    n = rollout.num_sequences
    tokens = rollout.sequence_mask.sum().item() + sum(len(p) for p in rollout.prompt_token_ids)
    metrics = {**rollout_metrics, **sums}
    metrics["timing/train_s"] = train_s
    metrics["tokens_per_s"] = tokens / max(train_s + rollout_metrics["timing/rollout_s"], 1e-9)
    metrics["lr"] = module.lr_schedulers().get_last_lr()[0]
    metrics.update(sampler_entropy_check(rollout, sums))
    from arctic_rl.zorro import dedup_stats, tree_dedup_stats

    if module.options.compute.zorro_dedup == "tree":  # the prefix tree's processed tokens
        stats = tree_dedup_stats(rollout.prompt_token_ids, rollout.response_ids, rollout.sequence_mask)
    else:
        stats = dedup_stats(rollout.prompt_token_ids, rollout.sequence_mask)
    metrics.update(stats.as_metrics(prefix="zorro/"))
    # over every rank: the reward's mean over ranks is exact (ranks hold equal batches), the loss is the sum of the
    # ranks' shares (the loss normalisers are global)
    logged = over_ranks({**{k: float(v) for k, v in metrics.items() if k != "reward/mean"}, "reward": float(rollout_metrics["reward/mean"])})
    reward, loss = logged.pop("reward"), logged.pop("loss")
    module.log_dict(logged, batch_size=n)
    module.log("reward", reward, prog_bar=True, batch_size=n)
    module.log("loss", loss, prog_bar=True, batch_size=n)
    # under ZeRO-3 Lightning never moves the module (nor its metrics) to the GPU: follow the data
    module.epoch_reward.to(rollout.rewards.device).update(rollout.rewards)
    module.log("reward/epoch_mean", module.epoch_reward, on_step=False, on_epoch=True)
    if "accuracy" in rollout_metrics:
        module.epoch_accuracy.to(rollout.rewards.device).update(rollout_metrics["accuracy"], weight=n)
        module.log("accuracy/epoch_mean", module.epoch_accuracy, on_step=False, on_epoch=True)


def over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric over every training rank (one all-gather of the small dict): the mean of the ranks that report it,
    their minimum / maximum for a stat named so (``is_extreme``; NaN: none), or their sum (``SUMMED``). Ranks hold equal batches, so a mean of
    per-rank means is the batch's mean for per-sequence stats (per-token stats weigh each rank equally). Unchanged
    with one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return metrics
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    out = {}
    for key in dict.fromkeys(k for ranked in gathered for k in ranked):
        values = [ranked[key] for ranked in gathered if key in ranked]
        if key in SUMMED:
            out[key] = sum(values)
        elif is_extreme(key):
            present = [v for v in values if not math.isnan(v)]
            out[key] = (min if key.endswith(("_min", "/min")) else max)(present) if present else math.nan
        else:
            out[key] = sum(values) / len(values)
    return out


def sampler_entropy_check(rollout, sums: dict[str, float]) -> dict[str, float]:
    """``sampling/sampler_nll``: the mean over generated tokens of minus the sampler's log-prob of the token it
    drew. An engine that samples from the distribution whose log-probs it reports has this equal, in
    expectation, to that distribution's entropy, so ``sampling/nll_minus_entropy`` (it less the trainer's
    ``entropy`` of the same tokens' distributions) stays near 0 (with ``top_p`` = 1; a nucleus makes it
    negative by design). A sampler that draws too greedily (a temperature or nucleus bug, a broken random
    stream) drives it below 0, one that draws too flat above, even while its reported log-probs match the
    trainer's (``sampler_logprob_diff``)."""
    mask = rollout.response_mask
    nll = -(rollout.sampler_logprobs * mask).sum().item() / max(mask.sum().item(), 1.0)
    out = {"sampling/sampler_nll": nll}
    if "entropy" in sums:
        out["sampling/nll_minus_entropy"] = nll - sums["entropy"]
    return out
