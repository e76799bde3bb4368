"""``ScoredGroups``: one sampling round's completions with their rewards, before advantages (what
dynamic sampling filters and tops up, a whole prompt group at a time)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arctic_rl.rollout.engines.base import Completion


@dataclass
class ScoredGroups:
    """``N = num_groups * G`` completions; the G samples of a prompt are contiguous."""

    prompt_token_ids: list[list[int]]  # N, equal within a group
    prompts: list  # N prompt texts or message lists
    columns: dict[str, list]  # the dataset's other columns, N values each
    outputs: list[Completion]  # N engine completions (token ids, sampler log-probs, finish reason)
    completions: list[str]  # N decoded completions
    rewards: torch.Tensor  # [N] float32, the reward advantages are computed from (what dynamic sampling filters on)
    weighted_rewards: torch.Tensor  # [N] float32, the weighted sum of the named rewards (logged); = rewards unless normalize_then_sum
    reward_components: dict[str, torch.Tensor]  # name -> [N] float32, NaN where not applicable (logging)
    group_size: int  # G
    # agent rollouts: the later token sequences of episodes the endpoint split, each (its episode's index in ``outputs``,
    # its prompt ids, its completion); trained as rows of their own after the batch's rows (``openai/agents.py``)
    split_rows: list[tuple[int, list[int], Completion]] = field(default_factory=list)

    @property
    def num_groups(self) -> int:
        return len(self.outputs) // self.group_size

    def take_groups(self, groups: list[int]) -> "ScoredGroups":
        """The prompt groups at ``groups``, in that order."""
        g = self.group_size
        rows = [i * g + k for i in groups for k in range(g)]
        index = torch.tensor(rows, dtype=torch.long)
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        where = {old: new for new, old in enumerate(rows)}
        return ScoredGroups(pick(self.prompt_token_ids), pick(self.prompts), {k: pick(v) for k, v in self.columns.items()},
                            pick(self.outputs), pick(self.completions), self.rewards[index], self.weighted_rewards[index],
                            {k: v[index] for k, v in self.reward_components.items()}, g,
                            [(where[e], p, c) for e, p, c in self.split_rows if e in where])

    @staticmethod
    def concat(parts: list["ScoredGroups"]) -> "ScoredGroups":
        """The groups of ``parts`` one after another (same columns and named rewards)."""
        first = parts[0]
        join = lambda get: [x for p in parts for x in get(p)]  # noqa: E731
        return ScoredGroups(
            join(lambda p: p.prompt_token_ids), join(lambda p: p.prompts),
            {k: join(lambda p, k=k: p.columns[k]) for k in first.columns},
            join(lambda p: p.outputs), join(lambda p: p.completions), torch.cat([p.rewards for p in parts]),
            torch.cat([p.weighted_rewards for p in parts]),
            {k: torch.cat([p.reward_components[k] for p in parts]) for k in first.reward_components}, first.group_size,
            [(e + sum(len(q.outputs) for q in parts[:i]), prompt, c) for i, p in enumerate(parts) for e, prompt, c in p.split_rows],
        )
