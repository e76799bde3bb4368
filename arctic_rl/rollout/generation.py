"""Turning a batch of prompts into a scored ``RolloutBatch``: generate (one turn, multi-turn episodes with an
environment: ``multi_turn.py``, or the user's agents against an OpenAI-compatible endpoint: ``openai/agents.py``), decode, reward (``rewards.py``), optionally top up groups of equal rewards
(``dynamic_sampling.py``), advantages."""

from __future__ import annotations

import time
from typing import Any

import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, PromptDataModule
from arctic_rl.rollout.batch import ROLLOUT, ROLLOUT_METRICS, RolloutBatch
from arctic_rl.rollout.dynamic_sampling import fill_batch, refill_prompts
from arctic_rl.rollout.engines.base import Completion, RolloutEngine, SamplingConfig
from arctic_rl.rollout.multi_turn import ENVIRONMENT, multi_turn_metrics, run_episodes
from arctic_rl.rollout.openai.agents import AGENT, agent_metrics, episode_text, run_agents, with_split_rows
from arctic_rl.rollout.policy import RolloutPolicy
from arctic_rl.rollout.rewards import RewardError, reward_metrics, score_completions  # noqa: F401  (RewardError: re-exported)
from arctic_rl.rollout.scored import ScoredGroups
from arctic_rl.rollout.engines.seeds import prompt_seeds


def sample_and_score(engine: RolloutEngine, module: RolloutPolicy, batch: dict[str, list], step: int, rank: int = 0, world_size: int = 1,
                     sampling_round: int = 0) -> tuple[ScoredGroups, float]:
    """Sample G completions per prompt of ``batch`` with ``engine`` and score them (``rewards.py``).
    Returns them and the seconds ``engine.generate`` took. ``rank``/``world_size`` place the batch in the
    step's global batch, so each prompt's sampling seed depends on its global slot (and round) only."""
    g, hp = module.group_size, module.options.sampling
    seeds = None if hp.seed is None else prompt_seeds(hp.seed, step, len(batch[PROMPT_IDS]), rank, world_size, sampling_round)
    sampling = SamplingConfig(
        n=g, max_tokens=hp.max_response_length, temperature=hp.temperature, top_p=hp.top_p, seed=hp.seed, prompt_seeds=seeds,
        return_routed_experts=module.options.corrections.router_replay,
    )
    environment, agent = module.options.rollout.environment, module.options.rollout.agent
    started = time.perf_counter()
    prompt_ids, split_rows = None, []  # agent rollouts: each group's prompt as rendered, the episodes' split-off sequences
    if agent is not None:
        rows = [{k: v[i] for k, v in batch.items() if k not in (ROLLOUT, ROLLOUT_METRICS)} for i in range(len(batch[PROMPT_IDS]))]
        ran = run_agents(engine, agent, module.tokenizer, rows, batch[PROMPT_IDS], g, sampling, hp.max_prompt_length)
        flat, prompt_ids, split_rows = ran.completions, ran.prompt_token_ids, ran.split_rows
    elif environment is None:
        outputs = engine.generate(batch[PROMPT_IDS], sampling)
        flat = [c for per_prompt in outputs for c in per_prompt]
        if any(len(per_prompt) != g for per_prompt in outputs):
            raise RuntimeError(f"engine returned {[len(o) for o in outputs]} completions per prompt, expected {g}")
    else:
        rows = [{k: v[i] for k, v in batch.items() if k not in (ROLLOUT, ROLLOUT_METRICS)} for i in range(len(batch[PROMPT_IDS]))]
        flat = run_episodes(engine, environment, module.tokenizer, rows, g, sampling, module.vocab_size)
    generate_s = time.perf_counter() - started
    scored = score_groups(module, batch, flat, g, prompt_ids)
    scored.split_rows = split_rows
    return scored, generate_s


def score_groups(module: RolloutPolicy, batch: dict[str, list], flat: list[Completion], g: int,
                 prompt_ids: list[list[int]] | None = None) -> ScoredGroups:
    """Decode and score ``flat`` (``[num_prompts * g]`` completions, the ``g`` of a prompt of ``batch`` contiguous) with the
    module's rewards (``rewards.py``); ``prompt_ids``: each prompt's ids when not ``batch``'s (agent rollouts)."""

    def repeat(values: list) -> list:
        return [v for v in values for _ in range(g)]

    prompts = repeat(batch[PROMPT])
    completions = module.tokenizer.batch_decode([c.token_ids for c in flat], skip_special_tokens=True)
    completions = [episode_text(c, text) for c, text in zip(flat, completions)]
    columns = {k: repeat(v) for k, v in batch.items() if k not in (PROMPT, PROMPT_IDS, ROLLOUT, ROLLOUT_METRICS)}
    rewards, weighted, components = score_completions(module, prompts, completions, columns, [len(c.token_ids) for c in flat],
                                                      **_environment_rewards(module, flat))
    return ScoredGroups(repeat(batch[PROMPT_IDS] if prompt_ids is None else prompt_ids), prompts, columns, flat, completions, rewards, weighted, components, g)


def _environment_rewards(module: RolloutPolicy, flat: list[Completion]) -> dict[str, Any]:
    """``score_completions``' episode arguments (multi-turn or agent rollouts): the environment's (or agent's) reward of
    each episode, whether the module's own ``reward`` is called (when it overrides ``GRPOModule.reward``), and the
    faulted episodes it does not score."""
    rollout = module.options.rollout
    if rollout.environment is None and rollout.agent is None:
        return {}
    env_reward = torch.tensor([c.episode["environment_reward"] for c in flat], dtype=torch.float64)
    faulted = torch.tensor([bool(c.episode["faulted"]) for c in flat])
    name = ENVIRONMENT if rollout.agent is None else AGENT
    return {"extra": {name: env_reward}, "call_user": not getattr(module.reward, "placeholder_reward", False),
            "not_applicable": faulted}


def generate_rollout(
    engine: RolloutEngine, module: RolloutPolicy, batch: dict[str, list], step: int, rank: int = 0, world_size: int = 1
) -> tuple[RolloutBatch, dict[str, float]]:
    """Sample G completions per prompt of ``batch`` with ``engine``, score them with ``module.reward``
    (with ``model.rollout.dynamic_sampling``: replace the groups of equal rewards, ``dynamic_sampling.py``) and
    compute advantages. Returns the batch and its rollout metrics."""
    hp = module.options.rollout
    scored, rollout_s = sample_and_score(engine, module, batch, step, rank, world_size)
    sampling_metrics: dict[str, float] = {}
    dynamic = hp.dynamic_sampling
    if dynamic is not None:
        seen, seconds = list(scored.prompt_token_ids), [rollout_s]

        def sample_round(r: int) -> ScoredGroups:
            extra, s = sample_and_score(engine, module, _refill(module, seen, len(batch[PROMPT_IDS]), step, r, rank),
                                        step, rank, world_size, sampling_round=r)
            seen.extend(extra.prompt_token_ids)
            seconds.append(s)
            return extra

        scored, sampling_metrics = fill_batch(scored, sample_round, dynamic.max_num_gen_batches)
        rollout_s = sum(seconds)
    rollout, metrics = build_rollout(module, scored, rollout_s)
    if scored.split_rows:
        rollout = with_split_rows(rollout, scored.split_rows, module.tokenizer)
    return rollout, {**metrics, **sampling_metrics}


def build_rollout(module: RolloutPolicy, scored: ScoredGroups, rollout_s: float) -> tuple[RolloutBatch, dict[str, float]]:
    """The ``RolloutBatch`` of scored groups: advantages (``module.compute_advantages``), the responses right-padded
    into tensors, and the batch's rollout metrics (``rollout_s``: the seconds its sampling took)."""
    g = scored.group_size
    flat, prompts, completions, columns, rewards = scored.outputs, scored.prompts, scored.completions, scored.columns, scored.rewards
    advantages = module.compute_advantages(rewards, g)
    if advantages.shape != rewards.shape:
        raise ValueError(f"compute_advantages returned shape {tuple(advantages.shape)}, expected {tuple(rewards.shape)}")

    r = max(len(c.token_ids) for c in flat)
    response_ids = torch.full((len(flat), r), module.tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(flat), r))
    sampler_logprobs = torch.zeros((len(flat), r))
    multi_turn = any(c.loss_mask is not None for c in flat)
    observation_mask = torch.zeros((len(flat), r)) if multi_turn else None
    for i, c in enumerate(flat):
        response_ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
        generated = torch.ones(len(c.token_ids)) if c.loss_mask is None else torch.tensor(c.loss_mask, dtype=torch.float32)
        response_mask[i, : len(c.token_ids)] = generated
        if observation_mask is not None:
            observation_mask[i, : len(c.token_ids)] = 1.0 - generated
        sampler_logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
    rollout = RolloutBatch(
        prompt_token_ids=scored.prompt_token_ids,
        response_ids=response_ids,
        response_mask=response_mask,
        sampler_logprobs=sampler_logprobs,
        rewards=scored.weighted_rewards,
        advantages=advantages,
        group_size=g,
        truncated=torch.tensor([c.finish_reason == "length" for c in flat]),
        prompts=prompts,
        completions=completions,
        reward_components=scored.reward_components,
        observation_mask=observation_mask,
        routed_experts=routing_of(scored.prompt_token_ids, flat, r) if module.options.corrections.router_replay else None,
    )
    metrics = rollout_metrics(module, rollout, rewards, flat, columns, rollout_s)
    return rollout, {**metrics, **reward_metrics(scored.reward_components), **multi_turn_metrics(flat), **agent_metrics(flat)}


def routing_of(prompt_token_ids: list[list[int]], flat: list[Completion], r: int) -> torch.Tensor:
    """The batch's ``routed_experts [N, max P + r, M, k]`` from each completion's (its prompt's tokens, then its own)."""
    missing = [i for i, c in enumerate(flat) if c.routed_experts is None]
    if missing:
        raise RuntimeError(f"corrections.router_replay: the engine returned no routed_experts for sample {missing[0]}")
    width = max(len(p) for p in prompt_token_ids) + r
    first = flat[0].routed_experts
    out = torch.full((len(flat), width, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (prompt, c) in enumerate(zip(prompt_token_ids, flat)):
        expected = len(prompt) + len(c.token_ids)
        if c.routed_experts.shape[0] != expected:
            raise RuntimeError(f"sample {i}: routed_experts covers {c.routed_experts.shape[0]} tokens, its prompt and response {expected}")
        out[i, :expected] = c.routed_experts
    return out


def _refill(module: RolloutPolicy, seen: list[list[int]], count: int, step: int, sampling_round: int, rank: int) -> dict[str, list]:
    """Dynamic sampling's extra prompts of one round, from the run's ``PromptDataModule``."""
    data = module.trainer.datamodule
    if not isinstance(data, PromptDataModule):
        raise TypeError(f"model.rollout.dynamic_sampling draws extra prompts from arctic_rl.PromptDataModule's rows, got {type(data).__name__}")
    return refill_prompts(data.train_rows, seen, count, data.seed, step, sampling_round, rank)


def rollout_metrics(module: RolloutPolicy, rollout: RolloutBatch, advantage_rewards: torch.Tensor, flat: list, columns: dict[str, Any],
                    rollout_s: float) -> dict[str, float]:
    """A rollout batch's metrics: ``reward/mean`` (logged as ``reward``) and ``reward/std`` of each sample's
    weighted reward sum (``rollout.rewards``, TRL's ``reward`` and ``reward_std``); under ``normalize_then_sum``
    also ``reward/normalized_{mean,std}`` of ``advantage_rewards`` (``[N]``, what advantages are computed
    from); ``reward/zero_std_group_frac``: the groups whose ``advantage_rewards`` are all equal (no signal)."""
    lengths = rollout.response_mask.sum(-1)
    grouped = advantage_rewards.view(-1, rollout.group_size)
    metrics = {
        "reward/mean": rollout.rewards.mean().item(),
        "reward/std": rollout.rewards.std().item(),
        "reward/zero_std_group_frac": (grouped.std(dim=1) == 0).float().mean().item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response/truncated_frac": sum(c.finish_reason == "length" for c in flat) / len(flat),
        "timing/rollout_s": rollout_s,
    }
    if module.options.rollout.multi_objective_aggregation == "normalize_then_sum":  # about 0 by construction: not the reward
        metrics["reward/normalized_mean"] = advantage_rewards.mean().item()
        metrics["reward/normalized_std"] = advantage_rewards.std().item()
    correct = module.is_correct(prompts=rollout.prompts, completions=rollout.completions, **columns)
    if correct is not None:
        if len(correct) != len(flat):
            raise ValueError(f"{type(module).__name__}.is_correct returned {len(correct)} values for {len(flat)} completions")
        metrics["accuracy"] = sum(bool(c) for c in correct) / len(flat)
    return metrics
