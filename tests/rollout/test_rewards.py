"""Rewards: validation (every way a user reward can go wrong names the sample), named rewards with
weights and ``None``, TRL 1.16's ``multi_objective_aggregation`` and DAPO's soft overlong penalty,
checked against values computed by hand from their definitions."""

import math
import re
from types import SimpleNamespace

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.rewards import (
    OverlongBuffer,
    RewardError,
    aggregate_rewards,
    batch_normalized_advantages,
    overlong_penalty,
    samples_table,
    score_completions,
)


class Task:
    """Stands in for a GRPOModule: scoring reads ``reward``, ``group_size`` and a few ``options``."""

    def __init__(self, fn, weights=None, aggregation="sum_then_normalize", overlong=None, group_size=2):
        self.fn, self.group_size = fn, group_size
        self.options = SimpleNamespace(
            rollout=SimpleNamespace(reward_weights=weights, multi_objective_aggregation=aggregation, reward_call_timeout_s=5.0,
                                    overlong_buffer=overlong),
            sampling=SimpleNamespace(max_response_length=10))

    def reward(self, prompts, completions, **columns):
        return self.fn(prompts, completions, **columns)


PROMPTS, COMPLETIONS = ["p0", "p0", "p1", "p1"], ["a", "b", "c", "d"]


def score(fn, columns=None, lengths=None, **kwargs):
    return score_completions(Task(fn, **kwargs), PROMPTS, COMPLETIONS, columns or {}, lengths)


def test_valid_rewards_and_columns_pass_through():
    seen = {}

    def fn(prompts, completions, answer):
        seen["answer"] = answer
        return [1, 0.5, True, 0]

    total, weighted, named = score(fn, {"answer": ["x", "x", "y", "y"]})
    torch.testing.assert_close(total, torch.tensor([1.0, 0.5, 1.0, 0.0]))
    assert torch.equal(weighted, total)
    assert seen["answer"] == ["x", "x", "y", "y"] and named == {}  # one list: no named rewards to log


def test_reward_that_raises_is_wrapped_with_context():
    def fn(prompts, completions):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"Task.reward raised KeyError: 'answer' \(scoring 4 completions") as info:
        score(fn)
    assert isinstance(info.value.__cause__, KeyError)


def test_wrong_length_is_an_error():
    with pytest.raises(RewardError, match="returned 3 rewards for 4 completions"):
        score(lambda p, c: [0.0] * 3)
    with pytest.raises(RewardError, match=r"Task.reward\['b'\] returned 3 rewards for 4 completions"):
        score(lambda p, c: {"a": [0.0] * 4, "b": [0.0] * 3})


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_names_the_sample(bad):
    with pytest.raises(RewardError, match=rf"returned {bad} for sample 2 \(prompt 'p1', completion 'c'\)"):
        score(lambda p, c: [0.0, 1.0, bad, 0.0])
    with pytest.raises(RewardError, match=rf"Task.reward\['fmt'\] returned {bad} for sample 2"):  # NaN is not None
        score(lambda p, c: {"ok": [1.0] * 4, "fmt": [None, 1.0, bad, 0.0]})


def test_non_numeric_reward_is_an_error():
    with pytest.raises(RewardError, match="must return a list of 4 floats"):
        score(lambda p, c: None)
    with pytest.raises(RewardError, match="must return a list of 4 floats"):
        score(lambda p, c: ["good"] * 4)
    with pytest.raises(RewardError, match="returned an empty dict"):
        score(lambda p, c: {})


def test_named_rewards_skip_none_and_use_weights():
    """TRL: ``nansum(w_k r_k)`` over the functions that apply; each named reward is kept for logging."""
    fn = lambda p, c: {"acc": [1.0, 0.0, None, 1.0], "fmt": [0.5, None, 0.25, 0.0]}  # noqa: E731
    total, weighted, named = score(fn, weights={"acc": 2.0, "fmt": -1.0})
    torch.testing.assert_close(total, torch.tensor([2.0 - 0.5, 0.0, -0.25, 2.0]))
    assert torch.equal(weighted, total)  # sum_then_normalize: the reward advantages come from is the weighted sum
    assert list(named) == ["acc", "fmt"] and math.isnan(named["acc"][2]) and math.isnan(named["fmt"][1])
    with pytest.raises(RewardError, match=r"no reward function scored samples \[1\]"):
        score(lambda p, c: {"acc": [1.0, None, 0.0, 1.0], "fmt": [0.5, None, 0.25, 0.0]})
    with pytest.raises(RewardError, match=r"reward_weights must name each reward returned, \['acc', 'fmt'\]: missing \['fmt'\]; unknown \['x'\]"):
        score(fn, weights={"acc": 1.0, "x": 1.0})


def test_normalize_then_sum_matches_trls_definition_by_hand():
    """TRL 1.16 ``normalize_then_sum``: per group and function ``(r - mean) / (std + 1e-4)`` (unbiased
    std, over the samples the function applies to), then ``sum_k w_k`` with None skipped."""
    components = {"a": torch.tensor([1.0, 3.0, 2.0, 2.0]), "b": torch.tensor([0.0, 1.0, 5.0, math.nan])}
    out = aggregate_rewards(components, {"a": 1.0, "b": 0.5}, 2, "normalize_then_sum")
    s = math.sqrt(2.0)  # unbiased std of {1, 3}; of {0, 1}: sqrt(0.5)
    a = [(1 - 2) / (s + 1e-4), (3 - 2) / (s + 1e-4), 0.0, 0.0]  # group 2 of "a": std 0 -> 0 / 1e-4 = 0
    b = [-0.5 / (math.sqrt(0.5) + 1e-4), 0.5 / (math.sqrt(0.5) + 1e-4), math.nan, math.nan]  # one value: std undefined, skipped
    expected = [a[0] + 0.5 * b[0], a[1] + 0.5 * b[1], a[2], a[3]]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    summed = aggregate_rewards(components, {"a": 1.0, "b": 0.5}, 2, "sum_then_normalize")
    torch.testing.assert_close(summed, torch.tensor([1.0, 3.5, 4.5, 2.0], dtype=torch.float64))


def test_normalize_then_sum_scores_the_normalised_sum_and_keeps_the_weighted_reward():
    """TRL 1.16 logs ``reward`` as ``nansum(w_k r_k)`` of the rewards as returned, under either aggregation;
    advantages come from the normalised sum."""
    fn = lambda p, c: {"acc": [1.0, 0.0, None, 1.0], "fmt": [0.5, None, 0.25, 0.0]}  # noqa: E731
    total, weighted, _ = score(fn, weights={"acc": 2.0, "fmt": -1.0}, aggregation="normalize_then_sum")
    torch.testing.assert_close(weighted, torch.tensor([2.0 - 0.5, 0.0, -0.25, 2.0]))
    acc, fmt = math.sqrt(0.5) + 1e-4, math.sqrt(0.03125) + 1e-4  # unbiased std + eps of group 1's {1, 0}, group 2's {0.25, 0}
    # a function with one value in a group (group 1's "fmt", group 2's "acc") is skipped there
    torch.testing.assert_close(total, torch.tensor([2.0 * 0.5 / acc, 2.0 * -0.5 / acc, -1.0 * 0.125 / fmt, -1.0 * -0.125 / fmt]))


def test_normalize_then_sum_advantages_are_normalised_over_the_batch():
    rewards = torch.tensor([1.0, -1.0, 3.0, 1.0])
    mean, std = 1.0, math.sqrt(8 / 3)  # unbiased
    expected = [(r - mean) / (std + 1e-4) for r in rewards.tolist()]
    torch.testing.assert_close(batch_normalized_advantages(rewards), torch.tensor(expected))


def test_overlong_penalty_is_dapo_eq_13():
    """L_max = 100, L_cache = 20: 0 up to 80 tokens, ((L_max - L_cache) - |y|) / L_cache up to 100, -1 beyond
    (TRL's docstring example: 90 tokens -> -0.5), scaled by verl's penalty_factor."""
    lengths = torch.tensor([10, 80, 81, 90, 100, 120])
    out = overlong_penalty(lengths, 100, OverlongBuffer(len=20))
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.05, -0.5, -1.0, -1.0], dtype=torch.float64))
    torch.testing.assert_close(overlong_penalty(lengths, 100, OverlongBuffer(20, penalty_factor=0.5)), out * 0.5)


def test_overlong_penalty_is_a_named_reward_added_to_the_reward():
    total, _, named = score(lambda p, c: [1.0, 1.0, 0.0, 0.0], lengths=[10, 9, 8, 2], overlong=OverlongBuffer(len=4))
    torch.testing.assert_close(total, torch.tensor([0.0, 0.25, -0.5, 0.0]))  # limit 10, buffer from 6 tokens
    assert list(named) == ["reward", "overlong_penalty"]
    with pytest.raises(RewardError, match="returned a reward named 'overlong_penalty'"):
        score(lambda p, c: {"overlong_penalty": [0.0] * 4}, lengths=[1] * 4, overlong=OverlongBuffer(len=4))


def test_option_errors_name_the_field():
    with pytest.raises(ConfigError, match="overlong_buffer.len must be >= 1"):
        OverlongBuffer(len=0)
    # the rules between reward options: tests/modules/test_options.py (RolloutOptions, check_settings)


def test_samples_table_has_a_column_per_named_reward():
    from arctic_rl.rollout.batch import RolloutBatch

    n = 2
    batch = RolloutBatch(prompt_token_ids=[[1], [1]], response_ids=torch.zeros(n, 1, dtype=torch.long), response_mask=torch.ones(n, 1),
                         sampler_logprobs=torch.zeros(n, 1), rewards=torch.tensor([1.5, 0.0]), advantages=torch.zeros(n), group_size=2,
                         prompts=["p", "p"], completions=["a", "b"], reward_components={"acc": torch.tensor([1.0, math.nan])})
    columns, rows = samples_table(batch, step=3, count=8)
    assert columns == ["step", "prompt", "completion", "reward", "acc"]
    assert rows == [[3, "p", "a", 1.5, 1.0], [3, "p", "b", 0.0, None]]  # None: the function did not apply
    assert batch.take([1]).reward_components["acc"].isnan().all() and RolloutBatch.concat([batch, batch]).reward_components["acc"].shape == (4,)


def test_a_finite_reward_beyond_float32_names_the_sample():
    with pytest.raises(RewardError, match=r"Task.reward returned 3.75e\+38 for sample 2 \(prompt 'p1', completion 'c'\): "
                                          r"it overflows float32 \(largest 3.403e\+38\)"):
        score(lambda p, c: [1.0, 0.0, 3.75e38, 0.0])


def test_rewards_whose_weighted_sum_overflows_float32_name_the_sample():
    with pytest.raises(RewardError, match=r"the weighted sum of Task.reward's rewards for sample 1 \(prompt 'p0'\) is 4e\+38, which overflows float32"):
        score(lambda p, c: {"a": [0.0, 2e38, 0.0, 0.0], "b": [0.0, 2e38, 0.0, 0.0]})


def test_a_reward_returning_a_coroutine_says_async_is_not_supported():
    async def fn(prompts, completions):
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"Task.reward returned a coroutine: async rewards are not supported"):
        score(fn)


@pytest.mark.timeout(60)
def test_a_reward_call_past_its_limit_stops_the_step_naming_the_setting():
    def stuck(prompts, completions, **columns):
        return [float(re.match(r"(a+)+$", "a" * 64 + "b") is None)] * len(completions)  # backtracks for ages

    with pytest.raises(RewardError, match=r"^Task.reward was stopped: 4 completions were still being scored after "
                                          r"model.rollout.reward_call_timeout_s=5 s \(first prompt 'p0'\); raise the limit"):
        score(stuck)
