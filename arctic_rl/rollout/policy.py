"""``RolloutPolicy``: what the rollout side (``RolloutCallback``, ``generation.py``, ``rewards.py``) needs from the
policy module it samples for. ``GRPOModule`` satisfies it; the rollout package imports nothing of ``modules/``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from arctic_rl.options import AgentOptions, DynamicSampling, EnvironmentOptions, OverlongBuffer, RewardAggregation


class SamplingSettings(Protocol):
    """What the engines sample (``GRPOModule.options.sampling``, ``options/sections.SamplingOptions``)."""

    seed: int | None
    temperature: float
    top_p: float
    max_response_length: int


class RewardSettings(Protocol):
    """From completions to rewards (``GRPOModule.options.rollout``, ``options/rollout.RolloutOptions``)."""

    dynamic_sampling: DynamicSampling | None  # run by dynamic_sampling.py
    overlong_buffer: OverlongBuffer | None
    reward_weights: dict[str, float] | None
    multi_objective_aggregation: RewardAggregation
    reward_call_timeout_s: float | None
    environment: EnvironmentOptions | None  # multi-turn: multi_turn.py
    agent: AgentOptions | None  # agent rollouts: openai/agents.py


class RoutingSetting(Protocol):
    """Whether the engine records each token's MoE routing for the trainer to replay
    (``options/corrections.CorrectionConfig.router_replay``, ``router_replay.py``)."""

    router_replay: bool


class RolloutSettings(Protocol):
    """The module's option sections a rollout reads (``GRPOModule.options``; ``arctic_rl/options/`` has their meanings)."""

    sampling: SamplingSettings
    rollout: RewardSettings
    corrections: RoutingSetting


class SamplerCorrection(Protocol):
    """Whether the loss corrects for the sampler (``options/corrections.CorrectionConfig``): then an overlapped rollout
    keeps the trainer's own old log-probs rather than taking the sampler's as the behaviour policy."""

    vllm_importance_sampling_correction: bool


class RolloutPolicy(Protocol):
    """The policy module as the rollout sees it: its settings, its tokenizer, the user's scoring hooks, and
    the ways its weights leave it (a ``save_pretrained`` directory, a stream of named tensors)."""

    options: RolloutSettings
    model_dtype: str  # the policy's parameter dtype (``float32``, ``bfloat16``, ...)
    tokenizer: Any  # a transformers tokenizer: pad_token_id, batch_decode
    vocab_size: int  # the policy model's vocabulary (embedding rows): token ids are in [0, vocab_size)
    group_size: int  # G, completions per prompt
    max_prompt_length: int
    max_response_length: int
    mini_batches: int  # optimizer steps per rollout batch (and per pass)
    num_iterations: int  # passes over each rollout batch
    corrections: SamplerCorrection
    device: torch.device
    trainer: Any  # the Lightning Trainer (its datamodule feeds dynamic sampling's extra prompts)

    def reward(self, prompts: list[str], completions: list[str], **columns: list) -> list[float] | dict[str, list[float]]:
        """``GRPOModule.reward``: one score per completion (or named lists of them)."""

    def is_correct(self, prompts: list[str], completions: list[str], **columns: list) -> list[bool] | None:
        """``GRPOModule.is_correct``: one bool per completion, or None."""

    def compute_advantages(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        """``GRPOModule.compute_advantages``: rewards ``[N]`` to advantages ``[N]``."""

    def save_policy(self, directory: str, bucket_bytes: int = 256 << 20) -> None:
        """``GRPOModule.save_policy``: the policy and tokenizer as a ``save_pretrained`` directory (a collective)."""

    def named_parameters_for_sync(self, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """``GRPOModule.named_parameters_for_sync``: ``(hf_name, full tensor)`` for every weight (a collective)."""

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        """``LightningModule.log``."""
