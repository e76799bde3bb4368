"""DAPO dynamic sampling, the filling rule itself (no engine): groups of equal rewards are dropped and
rounds sampled until the batch is full, at most ``max_num_gen_batches`` rounds, padded and logged at the
cap; refill prompts are a fixed function of (seed, step, round, rank). Trained through the real module
in ``tests/modules/test_rollout_options.py``."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.dynamic_sampling import DynamicSampling, fill_batch, informative, refill_prompts
from arctic_rl.rollout.engines.base import Completion
from arctic_rl.rollout.scored import ScoredGroups

G = 2


def groups(rewards: list[list[float]], tag: str) -> ScoredGroups:
    """One round: a group per reward list, prompt ``<tag><i>``."""
    flat = [r for group in rewards for r in group]
    names = [f"{tag}{i}" for i, group in enumerate(rewards) for _ in group]
    return ScoredGroups(prompt_token_ids=[[len(n)] for n in names], prompts=names, columns={"answer": names},
                        outputs=[Completion([1], [0.0], "stop") for _ in flat], completions=list(names),
                        rewards=torch.tensor(flat), weighted_rewards=torch.tensor(flat) + 10, reward_components={"acc": torch.tensor(flat)},
                        group_size=G)


def test_informative_groups_are_those_whose_rewards_differ():
    assert informative(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2) == [False, True, False]


def test_equal_groups_are_replaced_until_the_batch_is_full():
    first = groups([[1, 1], [0, 1], [0, 0], [0, 0]], "a")  # 1 of 4 informative
    rounds = {1: groups([[0, 0], [1, 0], [1, 1], [0, 0]], "b"), 2: groups([[0, 1], [1, 0], [0, 0], [1, 0]], "c")}
    asked = []

    def sample_round(r):
        asked.append(r)
        return rounds[r]

    batch, metrics = fill_batch(first, sample_round, max_rounds=10)
    assert asked == [1, 2]  # stops as soon as the batch is full
    assert batch.num_groups == 4 and all(informative(batch.rewards, G))
    assert batch.prompts[::G] == ["a1", "b1", "c0", "c1"]  # sampling order; c3 (informative) is surplus, dropped
    assert batch.columns["answer"][::G] == batch.prompts[::G] and batch.reward_components["acc"].tolist() == batch.rewards.tolist()
    assert (batch.weighted_rewards - 10).tolist() == batch.rewards.tolist()  # the logged reward travels with its group
    assert metrics == {"dynamic_sampling/rounds": 3.0, "dynamic_sampling/dropped_groups": 7.0,
                       "dynamic_sampling/padded_groups": 0.0, "dynamic_sampling/informative_frac": 5 / 12}


def test_the_cap_bounds_the_rounds_and_pads_with_dropped_groups():
    first = groups([[1, 1], [0, 1], [0, 0]], "a")
    batch, metrics = fill_batch(first, lambda r: groups([[0, 0], [1, 1], [1, 1]], f"r{r}"), max_rounds=2)
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/padded_groups"] == 2
    assert batch.num_groups == 3 and batch.prompts[::G] == ["a1", "a0", "a2"]  # informative first, then dropped in order
    only, metrics = fill_batch(first, lambda r: pytest.fail("no second round at max 1"), max_rounds=1)
    assert metrics["dynamic_sampling/rounds"] == 1 and only.prompts[::G] == ["a1", "a0", "a2"]
    with pytest.raises(ConfigError, match="max_num_gen_batches must be >= 1"):
        DynamicSampling(max_num_gen_batches=0)


def test_refill_prompts_are_fixed_by_seed_step_round_rank_and_skip_the_batch():
    rows = [{"prompt": f"p{i}", "prompt_token_ids": [i], "answer": str(i)} for i in range(10)]
    one = refill_prompts(rows, [[0], [1]], 4, seed=3, step=7, sampling_round=1, rank=0)
    assert one == refill_prompts(rows, [[0], [1]], 4, seed=3, step=7, sampling_round=1, rank=0)  # a resume draws the same
    assert set(one) == {"prompt", "prompt_token_ids", "answer"} and len(one["prompt"]) == 4
    assert not {0, 1} & {ids[0] for ids in one["prompt_token_ids"]}
    others = [refill_prompts(rows, [], 4, 3, *key)["prompt"] for key in ((7, 2, 0), (8, 1, 0), (7, 1, 1))]
    assert all(o != one["prompt"] for o in others)  # another round, step or rank: another draw
    everything = refill_prompts(rows, [[i] for i in range(8)], 4, 3, 7, 1, 0)  # only 2 fresh: reuse the rest
    assert sorted(ids[0] for ids in everything["prompt_token_ids"])[-2:] == [8, 9]
