"""``RolloutPolicy``: what the rollout side (``RolloutCallback``, ``generation.py``, ``rewards.py``) needs from the
policy module it samples for. ``GRPOModule`` satisfies it; the rollout package imports nothing of ``modules/``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch


class RolloutSettings(Protocol):
    """The module's hyperparameters a rollout reads (``GRPOModule.hparams``; its docstring has their meanings)."""

    seed: int | None
    temperature: float
    top_p: float
    max_response_length: int
    dtype: str
    dynamic_sampling: Any  # DynamicSampling, a dict of its fields, or None (read through rewards.typed_option)
    overlong_buffer: Any  # OverlongBuffer, a dict of its fields, or None
    reward_weights: dict[str, float] | None
    multi_objective_aggregation: str
    reward_call_timeout_s: float | None
    environment: Any  # EnvironmentOptions, a dict of its fields, or None (multi-turn: multi_turn.py)


class SamplerCorrection(Protocol):
    """Whether the loss corrects for the sampler (``corrections.CorrectionConfig``): then an overlapped rollout
    keeps the trainer's own old log-probs rather than taking the sampler's as the behaviour policy."""

    vllm_importance_sampling_correction: bool


class RolloutPolicy(Protocol):
    """The policy module as the rollout sees it: its settings, its tokenizer, the user's scoring hooks, and
    the ways its weights leave it (a ``save_pretrained`` directory, a stream of named tensors)."""

    hparams: RolloutSettings
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
