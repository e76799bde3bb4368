"""Overlapped rollouts (``RolloutCallback(max_staleness=k)``): the look-ahead iterator, the staleness and
weight-push schedule, rollouts generated ahead with a real transformers engine (same samples as generated
in place, behaviour log-probs as the old policy, saved and restored through a checkpoint), and a run with
a real vLLM engine in a Ray actor that logs staleness 1, clips against the behaviour policy and resumes
exactly from a checkpoint written with a rollout in flight."""

from __future__ import annotations

import io
import random

import pytest
import torch

from arctic_rl.data.lookahead import LookaheadIterator
from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
from arctic_rl.rollout.generation import generate_rollout
from arctic_rl.rollout.overlap import OverlappedRollouts


def test_lookahead_iterator_peeks_without_changing_the_order():
    batches = LookaheadIterator(iter(range(4)))
    seen = [next(batches)]
    assert batches.peek() == 1 and batches.peek() == 1  # a second peek fetches nothing more
    seen += list(batches)
    assert seen == [0, 1, 2, 3] and batches.peek() is None
    with pytest.raises(StopIteration):
        next(batches)


@pytest.mark.parametrize("k,staleness,pushes", [(1, [1] * 12, 12), (2, [1, 2] * 6, 6), (3, [1, 2, 3] * 4, 4)])
def test_staleness_is_bounded_by_k_and_weights_are_pushed_every_k_steps(k, staleness, pushes):
    """The callback's schedule over 12 steps, two optimizer steps per batch (the global step's unit)."""
    steps_per_batch, overlap = 2, OverlappedRollouts(generate_rollout, k, 2, weights_step=0)
    seen, pushed = [], 0
    for t in range(12):
        seen.append(overlap.staleness((t + 1) * steps_per_batch, overlap.weights_step))  # batch t+1, launched now
        if overlap.needs_sync((t + 1) * steps_per_batch):  # after step t's update
            overlap.synced((t + 1) * steps_per_batch)
            pushed += 1
    assert seen == staleness and pushed == pushes
    overlap.close()


@pytest.fixture(scope="module")
def echo_setup(tiny_model_dir, toy_task):
    """The toy task's module (tokenizer and reward only) and a real transformers engine on the tiny model."""
    from arctic_rl.rollout.engines.factory import make_engine
    from arctic_rl.modules.options import SamplingOptions
    from arctic_rl.tasks.toy import EchoDigitGRPO

    module = EchoDigitGRPO(model=str(tiny_model_dir), sampling=SamplingOptions(group_size=4, max_prompt_length=32, max_response_length=6, seed=3))
    engine = make_engine("transformers", str(tiny_model_dir), dtype="float32", max_model_len=64, seed=0, device="cpu",
                         engine_kwargs={})
    rows = load_rows(toy_task / "train.jsonl")[:8]
    batches = []
    for part in (rows[:4], rows[4:]):
        ids = [module.tokenizer(r["prompt"])["input_ids"] for r in part]
        batches.append({PROMPT: [r["prompt"] for r in part], PROMPT_IDS: ids, "answer": [r["answer"] for r in part]})
    return module, engine, batches


def test_a_rollout_generated_ahead_equals_one_generated_in_place_and_survives_a_checkpoint(echo_setup):
    module, engine, (first, second) = echo_setup
    overlap = OverlappedRollouts(lambda batch, step: generate_rollout(engine, module, batch, step), 1, 1, weights_step=4)
    overlap.launch(second, 5)  # during step 4, for step 5: the seeds are step 5's
    saved = io.BytesIO()
    torch.save(overlap.state_dict(), saved)  # as a checkpoint holds it, loaded as Lightning may (weights_only)
    restored = OverlappedRollouts(lambda batch, step: generate_rollout(engine, module, batch, step), 1, 1, weights_step=5)
    restored.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=True))

    in_place, _ = generate_rollout(engine, module, second, 5)
    for ahead in (overlap, restored):
        rollout, metrics = ahead.take(second, 5)
        assert metrics["rollout/staleness"] == 1.0  # sampled by step 4's weights, trained at step 5
        assert torch.equal(rollout.response_ids, in_place.response_ids) and rollout.completions == in_place.completions
        assert torch.equal(rollout.rewards, in_place.rewards)
        assert torch.equal(rollout.old_logprobs, rollout.sampler_logprobs)  # PPO's old policy: the behaviour policy
    overlap.close(), restored.close()


def test_a_rollout_generated_for_another_batch_is_replaced_by_one_generated_now(echo_setup):
    module, engine, (first, second) = echo_setup
    overlap = OverlappedRollouts(lambda batch, step: generate_rollout(engine, module, batch, step), 1, 1, weights_step=2)
    overlap.launch(second, 3)
    with pytest.warns(RuntimeWarning, match="rollout generated ahead for step 3 does not match the batch of step 3"):
        rollout, metrics = overlap.take(first, 3)
    assert metrics["rollout/staleness"] == 1.0  # generated now, by the engine's weights of step 2
    assert rollout.prompts == [p for p in first[PROMPT] for _ in range(4)]
    assert torch.equal(rollout.response_ids, generate_rollout(engine, module, first, 3)[0].response_ids)
    overlap.close()


def batch_prompts(rows: list[dict], batch_size: int, steps: int, seed: int = 0) -> list[list[str]]:
    """The prompts of each step of epoch 0 (``EpochShuffleSampler``: ``seed + epoch`` shuffles the rows)."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [[rows[i]["prompt"] for i in order[s * batch_size : (s + 1) * batch_size]] for s in range(steps)]


@pytest.mark.slow
def test_overlapped_run_on_a_ray_engine_actor_logs_staleness_1_and_resumes_exactly(toy_task, tmp_path):
    import ray

    from tests.helpers import quickstart_config
    from tests.modules.test_grpo import run_fit

    changes = {"trainer.max_steps": 3, "data.init_args.batch_size": 8, "model.init_args.sampling.group_size": 4,
               "model.init_args.optim.warmup_steps": 0}  # step 0 moves the weights (a warm-up starts at lr 0), so later steps are stale
    config = quickstart_config(toy_task, tmp_path / "ray", **changes)
    config["trainer"]["callbacks"][0]["init_args"].update(max_staleness=1, ray={"num_engines": 1, "timeout_s": 120})
    config["trainer"]["callbacks"][1]["init_args"]["every_n_train_steps"] = 2
    cli, full = run_fit(config, tmp_path / "ray.yaml")
    assert not ray.is_initialized()
    staleness = [row["rollout/staleness"] for row in logged_rows(tmp_path / "ray")]
    assert staleness == [0.0, 1.0, 1.0]  # the first batch is generated in place; the others one step ahead
    clipped = [row["clip_ratio/region_mean"] for row in logged_rows(tmp_path / "ray")]
    assert clipped[0] == 0.0 and max(clipped[1:]) > 0  # on-policy the ratio is 1; stale, it is taken to the sampler's
    expected = batch_prompts(load_rows(toy_task / "train.jsonl"), 8, 3)
    assert [full.steps[s]["prompts"] for s in range(3)] == expected

    # the checkpoint after step 1 holds batch 2's rollout, generated during step 1: the resumed step trains on it
    resumed_cfg = quickstart_config(toy_task, tmp_path / "resumed", **changes)
    resumed_cfg["trainer"]["callbacks"][0]["init_args"]["max_staleness"] = 1  # an in-process engine: same samples
    ckpt = tmp_path / "ray" / "checkpoints" / "epoch=0-step=2.ckpt"
    _, resumed = run_fit(resumed_cfg, tmp_path / "resumed.yaml", ckpt_path=str(ckpt))
    assert sorted(resumed.steps) == [2]
    assert resumed.steps[2]["prompts"] == full.steps[2]["prompts"]
    assert resumed.steps[2]["reward"] == pytest.approx(full.steps[2]["reward"], abs=1e-6)
    assert resumed.steps[2]["loss"] == pytest.approx(full.steps[2]["loss"], abs=1e-5)
    assert [row["rollout/staleness"] for row in logged_rows(tmp_path / "resumed")] == [1.0]


def logged_rows(root) -> list[dict[str, float]]:
    import csv

    (path,) = root.glob("logs/version_*/metrics.csv")
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f) if row.get("reward")]


def test_with_the_mismatch_correction_a_stale_batch_leaves_the_old_policy_to_the_trainer(echo_setup):
    """``behaviour_as_old=False`` (the module's ``vllm_importance_sampling_correction``): the trainer computes the
    old policy's log-probs and the correction's truncated weight ``pi_old / pi_sampler`` covers the lag."""
    module, engine, (first, second) = echo_setup
    overlap = OverlappedRollouts(lambda batch, step: generate_rollout(engine, module, batch, step), 1, 1,
                                 weights_step=4, behaviour_as_old=False)
    overlap.launch(second, 5)
    rollout, metrics = overlap.take(second, 5)
    assert metrics["rollout/staleness"] == 1.0 and rollout.old_logprobs is None
    overlap.close()
