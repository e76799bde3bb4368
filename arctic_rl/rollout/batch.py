"""``RolloutBatch``: the one thing that crosses from rollout to training; ``StepBatch``: the training step's batch
that carries it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import torch

ROLLOUT, ROLLOUT_METRICS = "rollout", "rollout_metrics"  # the keys RolloutCallback adds to a step's batch
STREAM_GROUPS = "stream_groups"  # and with the rollout stream: the ids of the groups the step trains on


@dataclass
class RolloutBatch:
    """``N = num_prompts * G`` sequences; the G samples of a prompt are contiguous. ``R`` is the
    longest response in the batch; responses are right-padded with ``pad_token_id``."""

    prompt_token_ids: list[list[int]]  # N lists (varlen, no padding); equal within a group
    response_ids: torch.Tensor  # [N, R] long
    response_mask: torch.Tensor  # [N, R] float, 1.0 on generated tokens (multi-turn: 0.0 on observation holes)
    sampler_logprobs: torch.Tensor  # [N, R] float, from the rollout engine
    rewards: torch.Tensor  # [N] float, each sample's reward: the weighted sum of its named rewards (logged as ``reward``)
    advantages: torch.Tensor  # [N] float (or [N, R], per token: the service's requests may send them)
    group_size: int  # G
    old_logprobs: torch.Tensor | None = None  # [N, R] policy before this batch's updates
    ref_logprobs: torch.Tensor | None = None  # [N, R] frozen reference model (KL only)
    truncated: torch.Tensor | None = None  # [N] bool, cut by the length limit (finish_reason "length")
    entropy_mask: torch.Tensor | None = None  # [N, R] float, trainer-filled: tokens top_entropy_quantile keeps
    prompts: list = field(default_factory=list)  # N prompt texts (for logging)
    completions: list[str] = field(default_factory=list)  # N decoded responses (for logging)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N] named rewards, NaN: not applicable (logging)
    observation_mask: torch.Tensor | None = None  # [N, R] float, multi-turn: 1.0 on the environment's tokens (None: none)
    token_versions: torch.Tensor | None = None  # [N, R] long, the rollout stream's: the global step of the weights that sampled each token
    # [N, W, M, k] int16, router replay (``corrections.router_replay``): row i's prompt at 0..P_i-1, its response from P_i on
    # (the naive layout, W >= P_i + R), the experts each of M MoE layers chose per token, -1 where none (``router_replay.py``)
    routed_experts: torch.Tensor | None = None

    @property
    def sequence_mask(self) -> torch.Tensor:
        """``[N, R]`` 1.0 on every response token, generated or the environment's: a right-padded prefix of ones
        per row, what the forward passes and packing read (lengths). The loss counts ``response_mask`` only."""
        return self.response_mask if self.observation_mask is None else self.response_mask + self.observation_mask

    @property
    def num_sequences(self) -> int:
        return self.response_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return self.num_sequences // self.group_size

    def to(self, device: torch.device | str) -> "RolloutBatch":
        moved = {
            name: getattr(self, name).to(device)
            for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages", "old_logprobs", "ref_logprobs",
                         "truncated", "entropy_mask", "observation_mask", "token_versions", "routed_experts")
            if getattr(self, name) is not None
        }
        return replace(self, **moved)

    def select(self, rows: slice) -> "RolloutBatch":
        """The sequences in ``rows`` (a micro- or mini-batch view; tensors are sliced, not copied)."""
        return replace(
            self,
            prompt_token_ids=self.prompt_token_ids[rows],
            response_ids=self.response_ids[rows],
            response_mask=self.response_mask[rows],
            sampler_logprobs=self.sampler_logprobs[rows],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[rows],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[rows],
            truncated=None if self.truncated is None else self.truncated[rows],
            entropy_mask=None if self.entropy_mask is None else self.entropy_mask[rows],
            observation_mask=None if self.observation_mask is None else self.observation_mask[rows],
            token_versions=None if self.token_versions is None else self.token_versions[rows],
            routed_experts=None if self.routed_experts is None else self.routed_experts[rows],
            prompts=self.prompts[rows],
            completions=self.completions[rows],
            reward_components={k: v[rows] for k, v in self.reward_components.items()},
        )

    def take(self, indices: list[int]) -> "RolloutBatch":
        """The sequences at ``indices``, in that order (copies)."""
        rows = torch.tensor(indices, dtype=torch.long, device=self.response_ids.device)
        pick = lambda t: None if t is None else t.index_select(0, rows)  # noqa: E731
        return replace(
            self,
            prompt_token_ids=[self.prompt_token_ids[i] for i in indices],
            response_ids=pick(self.response_ids),
            response_mask=pick(self.response_mask),
            sampler_logprobs=pick(self.sampler_logprobs),
            rewards=pick(self.rewards),
            advantages=pick(self.advantages),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            truncated=pick(self.truncated),
            entropy_mask=pick(self.entropy_mask),
            observation_mask=pick(self.observation_mask),
            token_versions=pick(self.token_versions),
            routed_experts=pick(self.routed_experts),
            prompts=[self.prompts[i] for i in indices] if self.prompts else [],
            completions=[self.completions[i] for i in indices] if self.completions else [],
            reward_components={k: v[indices] for k, v in self.reward_components.items()},
        )

    @staticmethod
    def concat(batches: list["RolloutBatch"]) -> "RolloutBatch":
        """The sequences of ``batches`` one after another (same group size); responses are right-padded
        (with id 0, under a zero mask) to the longest. Optional fields must be set in all or none."""
        width = max(b.response_ids.shape[1] for b in batches)
        if len({b.group_size for b in batches}) != 1:
            raise ValueError(f"cannot concatenate batches of group sizes {sorted({b.group_size for b in batches})}")

        def cat(name: str):
            parts = [getattr(b, name) for b in batches]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"cannot concatenate batches where only some have {name}")
            if parts[0].dim() == 1:
                return torch.cat(parts)
            return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

        return replace(
            batches[0],
            prompt_token_ids=[ids for b in batches for ids in b.prompt_token_ids],
            **{name: cat(name) for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages",
                                             "old_logprobs", "ref_logprobs", "truncated", "entropy_mask", "token_versions")},
            observation_mask=_cat_optional_mask(batches, width),
            routed_experts=_cat_routing(batches),
            prompts=[p for b in batches for p in b.prompts],
            completions=[c for b in batches for c in b.completions],
            reward_components={k: torch.cat([b.reward_components[k] for b in batches]) for k in batches[0].reward_components},
        )

    def split(self, num_chunks: int) -> list["RolloutBatch"]:
        """Split into ``num_chunks`` equal contiguous pieces of whole prompt groups (mini-batches)."""
        if self.num_groups % num_chunks:
            raise ValueError(f"cannot split {self.num_groups} prompt groups into {num_chunks} equal mini-batches")
        step = self.num_sequences // num_chunks
        return [self.select(slice(s, s + step)) for s in range(0, self.num_sequences, step)]


def _cat_routing(batches: list[RolloutBatch]) -> torch.Tensor | None:
    """The batches' routing one after another, padded to the widest with -1 (not routed)."""
    parts = [b.routed_experts for b in batches]
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise ValueError("cannot concatenate batches where only some have routed_experts")
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, width - p.shape[1]), value=-1) for p in parts])


def _cat_optional_mask(batches: list[RolloutBatch], width: int) -> torch.Tensor | None:
    """The batches' observation masks, one after another; a batch without one (single-turn) has none: zeros."""
    if all(b.observation_mask is None for b in batches):
        return None
    return torch.cat([torch.nn.functional.pad(b.observation_mask if b.observation_mask is not None else torch.zeros_like(b.response_mask),
                                              (0, width - b.response_ids.shape[1])) for b in batches])


class StepBatch(TypedDict, total=False):
    """What ``GRPOModule.training_step`` receives: the prompt loader's batch (``data.prompts``: ``prompt``,
    ``prompt_token_ids`` and the dataset's other columns, each a list over the batch's prompts), to which
    ``RolloutCallback.on_train_batch_start`` adds the scored rollout and its metrics. A plain dict at run time."""

    prompt: list[Any]  # [num_prompts] prompt texts (or chat messages)
    prompt_token_ids: list[list[int]]  # [num_prompts] tokenized prompts
    rollout: RolloutBatch  # [num_prompts * G] sequences, set by the rollout callback
    rollout_metrics: dict[str, float]  # reward/*, response_length/*, timing/rollout_s, ... of that rollout
    stream_groups: list[str]  # the rollout stream's: the groups trained on ("<step>/<slot>"; not the loader batch's prompts)
