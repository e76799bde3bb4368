"""``run_async`` (``serve/async_loop.py``): a producer thread sampling ahead while the trainer trains, against the real
service (the core with a transformers engine, in-process and behind a real HTTP server on loopback). The versions are
the ones the engines report with each completion. Where a test needs one interleaving of the two threads, its train
step waits for the producer to have sampled a given number of batches (a hang guard, not a timing assertion)."""

from __future__ import annotations

import threading

import pytest
import torch

from arctic_rl.errors import ConfigError
from arctic_rl.modules.advantages import group_advantages
from arctic_rl.serve.async_loop import Rollout, run_async, train_step
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient, Samples
from tests.serve.conftest import client_config

PROMPTS, G, STEPS = [[9, 12, 15, 20], [10, 11, 30]], 4, 3
PROBE = TrainBatch.build([[9, 12, 15, 20]] * 2, [[3, 4, 5], [6, 7]], [1.0, -1.0])  # read the weights through it


def advantages(out: Samples) -> torch.Tensor:
    """A reward that prefers short completions, so the gradient is not zero."""
    rewards = torch.tensor([-float(len(c)) for per in out.token_ids for c in per])
    return group_advantages(rewards, G, "grpo", "group")


class Producer:
    """The test's rollout function: batch ``i`` samples ``PROMPTS`` with seed ``i``; remembers what it sampled, in
    order, and lets a train step wait until ``count`` batches are sampled."""

    def __init__(self) -> None:
        self.samples: dict[int, Samples] = {}
        self.order: list[int] = []
        self.changed = threading.Condition()

    def __call__(self, client: ArcticRLClient, index: int) -> Rollout:
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=index)
        with self.changed:
            self.samples[index] = out
            self.order.append(index)
            self.changed.notify_all()
        return Rollout.of(out, advantages(out))

    def wait_for(self, count: int) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.order) >= count, timeout=120), f"{count} batches never sampled"


def waiting_train_step(producer: Producer, sampled_before: list[int], seen: list[TrainBatch]):
    """The default update, after waiting until the producer has sampled ``sampled_before[n]`` batches (n: the
    trainer's n-th update); remembers each batch it trained."""
    calls = iter(sampled_before)
    update = train_step()

    def step(client: ArcticRLClient, batch: TrainBatch) -> dict:
        producer.wait_for(next(calls))
        seen.append(batch)
        return update(client, batch)

    return step


def job(tiny_model_dir, tmp_path, protocol: str = "local") -> ArcticRLClient:
    return ArcticRLClient(client_config(tiny_model_dir, tmp_path, protocol=protocol, engines={"engine": "transformers"}))


@pytest.fixture(scope="module")
def synchronous_loop(tiny_model_dir, tmp_path_factory):
    """The loop written by hand (local): each step's completions, log-probs, loss and gradient norm, and the
    weights after the last step (read through ``PROBE``)."""
    with job(tiny_model_dir, tmp_path_factory.mktemp("sync")) as client:
        steps = []
        for step in range(STEPS):
            out = client.sample(PROMPTS, n=G, max_tokens=6, seed=step)
            metrics = client.forward_backward(out.train_batch(advantages(out)), "dapo")
            stepped = client.optim_step()
            client.sync_weights()
            steps.append((out.token_ids, out.logprobs, metrics["loss"], stepped["grad_norm"]))
        return steps, client.forward(PROBE)["logprobs"]


@pytest.mark.parametrize("protocol", ["local", "http"])
def test_bound_zero_is_the_synchronous_loop(protocol, synchronous_loop, tiny_model_dir, tmp_path):
    """Same completions, losses, gradient norms and weights as the loop written by hand, exactly."""
    expected, expected_weights = synchronous_loop
    producer = Producer()
    with job(tiny_model_dir, tmp_path, protocol) as client:
        run = run_async(client, producer, STEPS, max_staleness=0)
        weights = client.forward(PROBE)["logprobs"]
    assert run.dropped == [] and [t.index for t in run.trained] == producer.order == list(range(STEPS))
    assert [t.sampled_by for t in run.trained] == [[v] * len(PROMPTS) * G for v in range(STEPS)]
    got = [(producer.samples[t.index].token_ids, producer.samples[t.index].logprobs, t.metrics["loss"],
            t.metrics["grad_norm"]) for t in run.trained]
    assert got == expected
    assert torch.equal(weights, expected_weights)


@pytest.mark.parametrize("protocol", ["local", "http"])
def test_a_producer_one_batch_ahead_trains_on_batches_one_version_stale(protocol, tiny_model_dir, tmp_path):
    """k = 1: before each update the producer samples the next batch, from the weights the update is about to
    change, so batches 1 and 2 train one version stale, against the sampler's log-probs as their old policy."""
    producer, seen = Producer(), []
    with job(tiny_model_dir, tmp_path, protocol) as client:
        run = run_async(client, producer, STEPS, max_staleness=1,
                        train=waiting_train_step(producer, [2, 3, 3], seen))
        assert client.status()["weights_behind"] == 0  # the last update was pushed too
    assert run.dropped == [] and [t.index for t in run.trained] == producer.order == list(range(STEPS))
    assert [t.version for t in run.trained] == [0, 1, 2]
    assert [t.sampled_by for t in run.trained] == [[v] * len(PROMPTS) * G for v in (0, 0, 1)]
    assert [t.staleness for t in run.trained] == [0, 1, 1]
    assert seen[0].old_logprobs is None  # on-policy
    for batch in seen[1:]:
        assert torch.equal(batch.old_logprobs, batch.sampler_logprobs)
    assert all(torch.isfinite(torch.tensor([t.metrics["loss"], t.metrics["grad_norm"]])).all() for t in run.trained)


def test_a_producer_ahead_of_the_bound_has_its_stale_batches_dropped(tiny_model_dir, tmp_path):
    """k = 0 with the producer one batch ahead: every batch it samples during an update is one version stale when
    the trainer takes it, so it is dropped and replaced; the run trains 3 batches and drops 2, nothing else made."""
    producer, seen = Producer(), []
    with job(tiny_model_dir, tmp_path) as client:
        run = run_async(client, producer, STEPS, max_staleness=0, max_ahead=1,
                        train=waiting_train_step(producer, [2, 4, 5], seen))
    assert [t.index for t in run.trained] == [0, 2, 4] and [d.index for d in run.dropped] == [1, 3]
    assert producer.order == list(range(5))  # each batch made is trained once or dropped
    assert [t.sampled_by for t in run.trained] == [[v] * len(PROMPTS) * G for v in (0, 1, 2)]
    assert [t.staleness for t in run.trained] == [0, 0, 0] and all(b.old_logprobs is None for b in seen)
    assert [(d.version, d.sampled_by, d.staleness) for d in run.dropped] == [(1, [0] * 8, 1), (2, [1] * 8, 1)]


def test_bad_arguments_and_rollouts_are_refused_naming_them(tiny_model_dir, tmp_path):
    producer = Producer()
    client = job(tiny_model_dir, tmp_path)
    for kwargs, message in (({"num_steps": 0}, "num_steps must be an integer >= 1"),
                            ({"max_staleness": -1}, "max_staleness must be an integer >= 0"),
                            ({"max_staleness": True}, "max_staleness must be an integer >= 0"),
                            ({"max_staleness": 2, "max_ahead": 1}, r"max_ahead must be an integer >= max_staleness \(2\)")):
        with pytest.raises(ConfigError, match=message):
            run_async(client, producer, **({"num_steps": 1, "max_staleness": 0} | kwargs))
    assert producer.order == []  # refused before anything ran

    def fails_at_1(client, index):
        if index == 1:
            raise KeyError("no reward for this prompt")
        return producer(client, index)

    with client:
        with pytest.raises(RuntimeError, match="the rollout of batch 1 failed: 'no reward") as failed:
            run_async(client, fails_at_1, 2, max_staleness=0)
        assert isinstance(failed.value.__cause__, KeyError)
        with pytest.raises(RuntimeError, match="the rollout of batch 0 failed: the rollout function returned dict"):
            run_async(client, lambda client, index: {}, 1, max_staleness=0)

        def syncs(client, index):
            client.sync_weights()
            return producer(client, index)

        with pytest.raises(RuntimeError, match=r"batch 0 was sampled by engine weight version\(s\) \[2\], which this "
                                               r"loop did not push \(it pushed \[1\]\)"):
            run_async(client, syncs, 1, max_staleness=0)
        assert "arctic-rl-rollouts" not in {t.name for t in threading.enumerate()}  # every producer thread ended
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=0)
    with pytest.raises(ValueError, match="Rollout.weight_versions has 1 versions for 8 sequences"):
        Rollout(out.train_batch(advantages(out)), [0])
    with pytest.raises(ValueError, match="Samples.weight_versions is None"):
        Rollout.of(Samples(out.prompt_token_ids, out.token_ids, out.logprobs, out.text, out.finish_reason), advantages(out))
