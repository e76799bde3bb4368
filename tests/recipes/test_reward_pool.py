"""The reward time limit (``rewards/pool.py``): a job over its deadline is killed and the pool keeps
serving; a sample over the limit is an error naming it and the limit, or scores the configured
fallback; the GSM8K and multi-hop QA tasks score through it."""

import math
import time

import pytest

from arctic_rl.errors import ConfigError
from arctic_rl.recipes.gsm8k import GSM8KGRPO
from arctic_rl.recipes.multihop_qa import MultiHopQAGRPO
from arctic_rl.recipes.rewards.math import math_reward
from arctic_rl.recipes.rewards.pool import JobResult, SampleScorer, WorkerPool
from arctic_rl.rollout.rewards import RewardError, call_reward
from tests.helpers import REPO

TOKENIZER = str(REPO / "data/toy/tokenizer")


@pytest.mark.timeout(60)  # a 60 s sleep is cut at 0.5 s
def test_a_job_over_the_deadline_is_killed_and_the_pool_keeps_serving():
    with WorkerPool(time.sleep, num_workers=1, timeout_s=0.5) as pool:
        assert pool.run([(0,), (60,), (0,)]) == [JobResult("ok"), JobResult("timeout", message="no answer within 0.5 s; worker killed"),
                                                 JobResult("ok")]
        assert pool.replaced == 1
        with WorkerPool(math_reward, num_workers=1) as other:
            assert other.run([("#### 1", "seven"), ("#### 7", "7")]) == [
                JobResult("error", message="ValueError: gold answer 'seven' is not a number"), JobResult("ok", 1.0)]


class SleepyTask:
    """A task whose reward sleeps ``seconds`` per sample, under the limit of a ``SampleScorer``."""

    def __init__(self, fallback):
        self.scorer = SampleScorer(time.sleep, num_workers=1, timeout_s=0.5, fallback=fallback)

    def reward(self, prompts, completions, seconds):
        return self.scorer.score([(s,) for s in seconds], completions)


@pytest.mark.timeout(60)
def test_a_sample_over_the_limit_stops_the_step_naming_it_or_scores_the_fallback():
    task = SleepyTask(fallback=None)
    with pytest.raises(RewardError) as error:
        call_reward(task, ["p", "p"], ["fast", "slow"], {"seconds": [0, 60]})  # what a training step calls
    assert str(error.value) == ("SleepyTask.reward raised RewardTimeout: sleep took over model.reward_timeout_s=0.5 s on sample 1"
                                " (completion 'slow', 4 characters); set model.reward_fallback to score such samples instead"
                                " of stopping (scoring 2 completions; first prompt 'p')")
    task.scorer.close()
    task = SleepyTask(fallback=-1.0)
    assert task.reward(["p"] * 3, ["a", "b", "c"], [60, 0, 60]) == [-1.0, None, -1.0]
    assert task.scorer.timeouts == 2
    task.scorer.close()


@pytest.mark.parametrize("workers,timeout_s,fallback,message", [
    (0, 5.0, None, "model.reward_workers must be >= 1, got 0"),
    (1, 0.0, None, "model.reward_timeout_s must be a finite number of seconds > 0, got 0.0"),
    (1, math.inf, None, "model.reward_timeout_s must be a finite number of seconds > 0, got inf"),
    (1, 5.0, math.nan, "model.reward_fallback must be a finite score or null, got nan"),
])
def test_limits_are_checked_naming_the_key(workers, timeout_s, fallback, message):
    with pytest.raises(ConfigError) as error:
        SampleScorer(math_reward, workers, timeout_s, fallback)
    assert str(error.value) == message


def test_gsm8k_task_scores_through_the_pool_with_its_configured_limit():
    module = GSM8KGRPO(model={"model_type": "qwen3"}, tokenizer=TOKENIZER, reward_workers=1, reward_timeout_s=2.0, reward_fallback=0.0)
    completions = ["#### 72", "-" + " " * 80_000, "The answer is 1e999999", "\\boxed{12e3}"]
    try:
        assert (module.scorer.timeout_s, module.scorer.fallback) == (2.0, 0.0)
        assert module.reward([""] * 4, completions, answer=["72", "1", "1", "12000"]) == [1.0, 0.0, 0.0, 1.0]
        assert module.is_correct([""] * 4, completions, answer=["72", "1", "1", "12000"]) == [True, False, False, True]
    finally:
        module.teardown("fit")


def test_multihop_qa_task_scores_through_the_pool():
    module = MultiHopQAGRPO(model={"model_type": "qwen3"}, tokenizer=TOKENIZER, reward_workers=1)
    completions = ["Kovar was born in Prague.\nAnswer: the Vltava", "Answer: Vltava river", "Answer: Danube", "\n" * 20_000]
    try:
        assert module.reward([""] * 4, completions, [["Vltava"]] * 4) == pytest.approx([1.0, 0.5 * 2 / 3, 0.0, 0.0])
        assert module.is_correct([""] * 4, completions, [["Vltava"]] * 4) == [True, False, False, False]
    finally:
        module.teardown("fit")
