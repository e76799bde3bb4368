"""Turning a batch of prompts into a scored ``RolloutBatch``: generate, decode, reward, advantages."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.rollout.engine import RolloutEngine, SamplingConfig
from arctic_rl.rollout.seeds import prompt_seeds


class RewardError(RuntimeError):
    """A user reward function raised, or returned something unusable."""


def score_completions(module, prompts: list, completions: list[str], columns: dict[str, list]) -> torch.Tensor:
    """Call ``module.reward`` and validate its answer: ``N`` finite floats, else a ``RewardError``
    naming the offending sample."""
    n, name = len(completions), f"{type(module).__name__}.reward"
    try:
        out = module.reward(prompts=prompts, completions=completions, **columns)
    except Exception as e:
        raise RewardError(f"{name} raised {type(e).__name__}: {e} (scoring {n} completions; first prompt {str(prompts[0])[:80]!r})") from e
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as e:
        raise RewardError(f"{name} must return a list of {n} floats, got {type(out).__name__}: {e}") from None
    if len(values) != n:
        raise RewardError(f"{name} returned {len(values)} rewards for {n} completions")
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise RewardError(f"{name} returned {v} for sample {i} (prompt {str(prompts[i])[:80]!r}, completion {completions[i][:80]!r})")
    return torch.tensor(values, dtype=torch.float32)


def generate_rollout(
    engine: RolloutEngine, module, batch: dict[str, list], step: int, rank: int = 0, world_size: int = 1
) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample G completions per prompt of ``batch`` with ``engine``, score them with ``module.reward``
    and compute advantages. Returns the batch and its rollout metrics. ``rank``/``world_size`` place
    the batch in the step's global batch, so each prompt's sampling seed depends on its global slot only."""
    g, hp = module.group_size, module.hparams
    seeds = prompt_seeds(hp.seed, step, len(batch[PROMPT_IDS]), rank, world_size)
    sampling = SamplingConfig(
        n=g, max_tokens=hp.max_response_length, temperature=hp.temperature, top_p=hp.top_p, seed=hp.seed, prompt_seeds=seeds
    )
    started = time.perf_counter()
    outputs = engine.generate(batch[PROMPT_IDS], sampling)
    rollout_s = time.perf_counter() - started
    flat = [c for per_prompt in outputs for c in per_prompt]
    if any(len(per_prompt) != g for per_prompt in outputs):
        raise RuntimeError(f"engine returned {[len(o) for o in outputs]} completions per prompt, expected {g}")

    def repeat(values: list) -> list:
        return [v for v in values for _ in range(g)]

    prompts = repeat(batch[PROMPT])
    completions = module.tokenizer.batch_decode([c.token_ids for c in flat], skip_special_tokens=True)
    columns = {k: repeat(v) for k, v in batch.items() if k not in (PROMPT, PROMPT_IDS, "rollout", "rollout_metrics")}
    rewards = score_completions(module, prompts, completions, columns)
    advantages = module.compute_advantages(rewards, g)
    if advantages.shape != rewards.shape:
        raise ValueError(f"compute_advantages returned shape {tuple(advantages.shape)}, expected {tuple(rewards.shape)}")

    r = max(len(c.token_ids) for c in flat)
    response_ids = torch.full((len(flat), r), module.tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(flat), r))
    sampler_logprobs = torch.zeros((len(flat), r))
    for i, c in enumerate(flat):
        response_ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        response_mask[i, : len(c.token_ids)] = 1.0
        sampler_logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
    rollout = RolloutBatch(
        prompt_token_ids=repeat(batch[PROMPT_IDS]),
        response_ids=response_ids,
        response_mask=response_mask,
        sampler_logprobs=sampler_logprobs,
        rewards=rewards,
        advantages=advantages,
        group_size=g,
        truncated=torch.tensor([c.finish_reason == "length" for c in flat]),
        prompts=prompts,
        completions=completions,
    )
    return rollout, rollout_metrics(module, rollout, flat, columns, rollout_s)


def rollout_metrics(module, rollout: RolloutBatch, flat: list, columns: dict[str, Any], rollout_s: float) -> dict[str, float]:
    lengths = rollout.response_mask.sum(-1)
    grouped = rollout.rewards.view(-1, rollout.group_size)
    metrics = {
        "reward/mean": rollout.rewards.mean().item(),
        "reward/std": rollout.rewards.std().item(),
        "reward/zero_std_group_frac": (grouped.std(dim=1) == 0).float().mean().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in flat) / len(flat),
        "timing/rollout_s": rollout_s,
    }
    correct = module.is_correct(prompts=rollout.prompts, completions=rollout.completions, **columns)
    if correct is not None:
        if len(correct) != len(flat):
            raise ValueError(f"{type(module).__name__}.is_correct returned {len(correct)} values for {len(flat)} completions")
        metrics["accuracy"] = sum(bool(c) for c in correct) / len(flat)
    return metrics
