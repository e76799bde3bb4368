"""A scored rollout batch and its metrics, from a real transformers engine on the tiny model: the logged
``reward`` is each sample's weighted sum of its named rewards (TRL 1.16's ``reward``) under either
``multi_objective_aggregation``; under ``normalize_then_sum`` the per-group normalised sum that advantages
come from is logged apart, as ``reward/normalized_{mean,std}``."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.rewards import aggregate_rewards, batch_normalized_advantages
from arctic_rl.tasks.toy import EchoDigitGRPO, echo_score

WEIGHTS = {"echo": 1.0, "length": 0.5}


class EchoAndLength(EchoDigitGRPO):
    """Two named rewards; ``length`` does not apply (None) to prompts whose digit is odd."""

    def reward(self, prompts, completions, answer, **columns):
        return {"echo": [echo_score(c, a) for c, a in zip(completions, answer)],
                "length": [None if int(a) % 2 else len(c.split()) / 8 for c, a in zip(completions, answer)]}


@pytest.fixture(scope="module")
def engine_and_batch(tiny_model_dir, toy_task):
    from arctic_rl.rollout.engines.factory import make_engine

    engine = make_engine("transformers", str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0, device="cpu",
                         engine_kwargs={})
    rows = load_rows(toy_task / "train.jsonl")[:4]
    assert {int(r["answer"]) % 2 for r in rows} == {0, 1}  # both kinds of prompt: `length` applies to some only
    return engine, rows


def rollout_of(tiny_model_dir, engine_and_batch, aggregation: str):
    engine, rows = engine_and_batch
    module = EchoAndLength(model=str(tiny_model_dir), group_size=4, max_prompt_length=32, max_response_length=6, seed=3,
                           reward_weights=WEIGHTS, multi_objective_aggregation=aggregation)
    batch = {PROMPT: [r["prompt"] for r in rows], PROMPT_IDS: [module.tokenizer(r["prompt"])["input_ids"] for r in rows],
             "answer": [r["answer"] for r in rows]}
    return generate_rollout(engine, module, batch, step=0)


def weighted_by_hand(components: dict[str, torch.Tensor]) -> torch.Tensor:
    echo, length = components["echo"].double(), components["length"].double()
    return WEIGHTS["echo"] * echo + torch.where(length.isnan(), 0.0, WEIGHTS["length"] * length)


def test_normalize_then_sum_logs_the_weighted_reward_and_the_normalised_one_apart(tiny_model_dir, engine_and_batch):
    rollout, metrics = rollout_of(tiny_model_dir, engine_and_batch, "normalize_then_sum")
    raw = weighted_by_hand(rollout.reward_components)
    assert raw.mean().item() > 0.1  # the completions score: a logged mean of about 0 would be the normalised sum
    torch.testing.assert_close(rollout.rewards.double(), raw, rtol=0, atol=1e-6)
    assert metrics["reward/mean"] == pytest.approx(raw.mean().item(), abs=1e-6)  # logged as `reward`
    assert metrics["reward/std"] == pytest.approx(raw.std().item(), abs=1e-6)
    normalized = aggregate_rewards({k: v.double() for k, v in rollout.reward_components.items()}, WEIGHTS, 4, "normalize_then_sum")
    assert metrics["reward/normalized_mean"] == pytest.approx(normalized.mean().item(), abs=1e-6)
    assert abs(metrics["reward/normalized_mean"]) < 1e-5  # each group's normalised rewards sum to 0
    assert metrics["reward/normalized_std"] == pytest.approx(normalized.std().item(), abs=1e-6)
    torch.testing.assert_close(rollout.advantages, batch_normalized_advantages(normalized.float()), rtol=0, atol=1e-5)
    grouped = normalized.view(-1, 4)
    assert metrics["reward/zero_std_group_frac"] == (grouped.std(dim=1) == 0).float().mean().item()


def test_sum_then_normalize_logs_the_same_weighted_reward_and_no_normalised_one(tiny_model_dir, engine_and_batch):
    rollout, metrics = rollout_of(tiny_model_dir, engine_and_batch, "sum_then_normalize")
    raw = weighted_by_hand(rollout.reward_components)
    torch.testing.assert_close(rollout.rewards.double(), raw, rtol=0, atol=1e-6)
    assert metrics["reward/mean"] == pytest.approx(raw.mean().item(), abs=1e-6)
    assert "reward/normalized_mean" not in metrics and "reward/normalized_std" not in metrics
