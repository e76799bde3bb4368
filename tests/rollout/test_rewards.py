"""Reward validation: every way a user reward can go wrong gives an error naming the sample."""

import math

import pytest
import torch

from arctic_rl.rollout.generation import RewardError, score_completions


class Task:
    """Stands in for a GRPOModule: score_completions only calls ``reward``."""

    def __init__(self, fn):
        self.fn = fn

    def reward(self, prompts, completions, **columns):
        return self.fn(prompts, completions, **columns)


PROMPTS, COMPLETIONS = ["p0", "p0", "p1", "p1"], ["a", "b", "c", "d"]


def test_valid_rewards_and_columns_pass_through():
    seen = {}

    def fn(prompts, completions, answer):
        seen["answer"] = answer
        return [1, 0.5, True, 0]

    out = score_completions(Task(fn), PROMPTS, COMPLETIONS, {"answer": ["x", "x", "y", "y"]})
    torch.testing.assert_close(out, torch.tensor([1.0, 0.5, 1.0, 0.0]))
    assert seen["answer"] == ["x", "x", "y", "y"]


def test_reward_that_raises_is_wrapped_with_context():
    def fn(prompts, completions):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"Task.reward raised KeyError: 'answer' \(scoring 4 completions") as info:
        score_completions(Task(fn), PROMPTS, COMPLETIONS, {})
    assert isinstance(info.value.__cause__, KeyError)


def test_wrong_length_is_an_error():
    with pytest.raises(RewardError, match="returned 3 rewards for 4 completions"):
        score_completions(Task(lambda p, c: [0.0] * 3), PROMPTS, COMPLETIONS, {})


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_reward_names_the_sample(bad):
    with pytest.raises(RewardError, match=rf"returned {bad} for sample 2 \(prompt 'p1', completion 'c'\)"):
        score_completions(Task(lambda p, c: [0.0, 1.0, bad, 0.0]), PROMPTS, COMPLETIONS, {})


def test_non_numeric_reward_is_an_error():
    with pytest.raises(RewardError, match="must return a list of 4 floats"):
        score_completions(Task(lambda p, c: None), PROMPTS, COMPLETIONS, {})
    with pytest.raises(RewardError, match="must return a list of 4 floats"):
        score_completions(Task(lambda p, c: ["good"] * 4), PROMPTS, COMPLETIONS, {})
