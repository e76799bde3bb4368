"""``deal_across_ranks``: the pure part of cross-rank balancing (the 2-rank training run is in
tests/strategies)."""

import pytest
import torch

from arctic_rl.modules.rank_balance import deal_across_ranks, max_over_mean_tokens
from arctic_rl.rollout.batch import RolloutBatch


def groups(prompt_lengths, response_length, g=2):
    prompts = [[k + 1] * p for k, p in enumerate(prompt_lengths) for _ in range(g)]
    n = len(prompts)
    return RolloutBatch(prompt_token_ids=prompts, response_ids=torch.ones(n, response_length, dtype=torch.long),
                        response_mask=torch.ones(n, response_length), sampler_logprobs=torch.zeros(n, response_length),
                        rewards=torch.zeros(n), advantages=torch.zeros(n), group_size=g)


def test_heavy_rank_gives_groups_away():
    heavy, light = groups([30, 20, 10], 5), groups([2], 5)  # packed tokens 40+30+20 = 90 vs 12
    dealt, metrics = deal_across_ranks([heavy, light], token_budget=100)
    assert metrics["zorro/rank_tokens_max_over_mean_before"] == pytest.approx(90 / 51)
    assert max_over_mean_tokens(dealt) == pytest.approx(metrics["zorro/rank_tokens_max_over_mean"])
    assert metrics["zorro/rank_tokens_max_over_mean"] == pytest.approx(52 / 51)  # {40, 12} vs {30, 20}: 52 vs 50 tokens
    assert sum(b.num_sequences for b in dealt) == 8


def test_own_batches_kept_when_the_deal_is_no_better():
    a, b = groups([10], 5), groups([10], 5)
    dealt, metrics = deal_across_ranks([a, b], token_budget=100)
    assert dealt is None
    assert metrics["zorro/rank_tokens_max_over_mean"] == metrics["zorro/rank_tokens_max_over_mean_before"] == 1.0
