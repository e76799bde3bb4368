"""The rollout stream's in-flight weight updates and budget in seconds on a pool of Ray engine replicas
(``engines/ray/actor.py``, ``pool.py``), on a real 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
two CPUs per node) with two transformers replicas placed ``SPREAD`` (one per node) and synced by the real
``WeightSyncCoordinator`` over gloo:

- a sync pushed while both replicas decode enters each at the step boundary it reached, no request is dropped, every
  token's version is exact, and every log-prob equals the model's own forward at that token's weights (1e-4);
- the stream with ``in_flight=True`` on the pool stamps each token with the global step whose weights sampled it;
- a budget in seconds reaches every replica (a deadline already past: one token a round on each), the cut samples
  continue in the next rounds, and a deadline far ahead cuts nothing;
- a replica killed mid-round fails the round with an error naming the replica and its node, not a hang.

One cluster and one pool for the module (the kill comes last), shut down after it."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from arctic_rl.rollout.engines.base import SamplingConfig, StopsAtDeadline, UpdatesInFlight
from tests.ray_nodes import local_ray_nodes
from tests.rollout.test_in_flight import PROMPTS, SWITCH, logprobs_across_switch

pytestmark = pytest.mark.slow
HOLD_S = 120.0  # the longest a held decode waits for the sync (or the kill) at its boundary


@pytest.fixture(scope="module")
def pool(tiny_model_dir):
    """Two transformers replicas, one on each of the cluster's two nodes, and the coordinator that syncs them."""
    from arctic_rl.rollout.engines.ray.pool import EnginePool
    from arctic_rl.weight_sync.coordinator import WeightSyncCoordinator

    with local_ray_nodes(head_cpus=2, node_cpus=[2], connect=True):
        import ray

        pool = EnginePool("transformers", str(tiny_model_dir), num_engines=2, dtype="float32", max_model_len=64,
                          placement_strategy="SPREAD", ship_model_files=True)
        try:
            assert len({place["node_id"] for place in pool.places}) == 2  # one replica per node
            pool.sync = WeightSyncCoordinator(pool.actors, backend="gloo", timeout_s=120, host=ray.util.get_node_ip_address())
            yield pool
        finally:
            pool.shutdown()


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """The model (for reference forwards), its weights and a perturbed copy (the "new" weights)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    old = {k: v.clone() for k, v in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(7)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=generator) if v.is_floating_point() else v.clone() for k, v in old.items()}
    return reference, old, new


# ---------------------------------------------------------------- run in a replica's process (``__ray_call__``)
def _hold(actor, boundary: int) -> None:
    """The replica's next decode waits at its ``boundary``-th step boundary until a weight load wants the pause."""
    gate, calls = actor.engine.gate, [0]
    real, gate.at_boundary = type(gate).checkpoint.__get__(gate), threading.Event()

    def checkpoint() -> int:
        calls[0] += 1
        if calls[0] == boundary:
            gate.at_boundary.set()
            until = time.monotonic() + HOLD_S
            while not gate.wanted and time.monotonic() < until:
                time.sleep(0.001)
        return real()

    gate.checkpoint = checkpoint


def _at_boundary(actor) -> bool:
    return actor.engine.gate.at_boundary.is_set()


def _release(actor) -> None:
    actor.engine.gate.__dict__.pop("checkpoint", None)


def hold(pool, boundary: int, replicas: list[int]) -> None:
    import ray

    ray.get([pool.actors[i].__ray_call__.remote(_hold, boundary) for i in replicas])


def wait_at_boundary(pool, replicas: list[int]) -> None:
    """Until every replica of ``replicas`` is held at its boundary (asked on the actor's ``control`` thread, beside the
    decode)."""
    import ray

    until = time.monotonic() + HOLD_S
    while not all(ray.get([pool.actors[i].__ray_call__.options(concurrency_group="control").remote(_at_boundary) for i in replicas])):
        assert time.monotonic() < until, "the replicas' decode did not reach the held boundary"
        time.sleep(0.01)


def release(pool) -> None:
    import ray

    ray.get([a.__ray_call__.remote(_release) for a in pool.actors])


def toy_stream_inputs(tiny_model_dir, toy_task, count: int):
    from arctic_rl.data.prompts import PROMPT, PROMPT_IDS, load_rows
    from arctic_rl.modules.options import SamplingOptions
    from arctic_rl.tasks.toy import EchoDigitGRPO

    module = EchoDigitGRPO(model=str(tiny_model_dir), sampling=SamplingOptions(
        group_size=2, max_prompt_length=32, max_response_length=7, temperature=1.0, seed=5))
    rows = load_rows(toy_task / "train.jsonl")[: 4 * count]
    batches = [{PROMPT: [r["prompt"] for r in part], PROMPT_IDS: [module.tokenizer(r["prompt"])["input_ids"] for r in part],
                "answer": [r["answer"] for r in part]} for part in (rows[4 * i : 4 * i + 4] for i in range(count))]
    return module, batches


# ---------------------------------------------------------------- tests
def test_a_sync_pushed_while_the_replicas_decode_enters_each_at_a_step_boundary(pool, weights):
    from arctic_rl.rollout.engines.ray.pool import balance_prompts

    reference, old, new = weights
    assert isinstance(pool, UpdatesInFlight) and isinstance(pool, StopsAtDeadline)
    pool.sync.sync(iter(old.items()))
    start = pool.weight_version
    sampling = SamplingConfig(n=3, max_tokens=12, seed=3)
    assert sorted(balance_prompts([len(p) for p in PROMPTS], 3, 12, 2)) == [[0], [1]]  # one prompt on each replica
    hold(pool, SWITCH + 1, [0, 1])  # boundary 1 is before the prefill (token 0)
    try:
        with ThreadPoolExecutor(1) as background:
            round_ = background.submit(pool.generate, PROMPTS, sampling)
            wait_at_boundary(pool, [0, 1])
            pool.sync.sync(iter(new.items()))  # returns once both replicas loaded it, their decodes paused
            outputs = round_.result(timeout=HOLD_S)
    finally:
        release(pool)
    assert pool.weight_version == start + 1 and [r["weight_version"] for r in pool.replicas()] == [start + 1] * 2
    assert [len(per) for per in outputs] == [3, 3]  # no request dropped
    long_enough = 0
    for prompt, per in zip(PROMPTS, outputs):
        for c in per:
            assert c.token_versions == [start if t < SWITCH else start + 1 for t in range(len(c.token_ids))]
            assert c.weight_version == c.token_versions[-1]
            assert c.logprobs == pytest.approx(logprobs_across_switch(reference, old, new, prompt, c.token_ids, SWITCH), abs=1e-4)
            long_enough += len(c.token_ids) > SWITCH + 1
    assert long_enough >= 3  # the check reached tokens on both sides of the switch


def test_the_stream_on_the_pool_pushes_weights_while_its_round_runs(pool, weights, tiny_model_dir, toy_task):
    """``RolloutStream(in_flight=True)`` over the pool: the step-1 weights are pushed while batch 1's round decodes on
    both replicas (held at their third boundary), and every trained token says which step's weights sampled it."""
    from arctic_rl.rollout.stream.stream import RolloutStream

    _, old, new = weights
    pool.sync.sync(iter(old.items()))
    module, batches = toy_stream_inputs(tiny_model_dir, toy_task, 2)
    stream = RolloutStream(pool, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, in_flight=True)
    try:
        stream.admit(batches[0], 0)
        stream.take(4, 0)
        hold(pool, 3, [0, 1])
        stream.launch([(batches[1], 1)], 1)
        wait_at_boundary(pool, [0, 1])
        stream.before_sync(1)
        pool.sync.sync(iter(new.items()))
        stream.synced(1)
        rollout, metrics, _ = stream.take(4, 1)
    finally:
        stream.close()
        release(pool)
    lengths = rollout.response_mask.sum(-1).long().tolist()
    for i, n in enumerate(lengths):
        assert rollout.token_versions[i, :n].tolist() == [0 if t < 2 else 1 for t in range(n)]
    assert sum(n > 2 for n in lengths) >= 3
    assert metrics["rollout/staleness"] == 1.0 and 0 < metrics["stream/staleness_frac_1"] < 1


def test_a_budget_in_seconds_reaches_every_replica_and_the_cut_samples_continue(pool, tiny_model_dir, toy_task):
    """A deadline already past when each call arrives: every replica returns one token per sample, and the step's
    catch-up rounds continue the samples until every group is complete. A deadline an hour ahead cuts nothing."""
    from arctic_rl.rollout.stream.stream import RolloutStream

    module, [batch] = toy_stream_inputs(tiny_model_dir, toy_task, 1)
    stream = RolloutStream(pool, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, budget_s=1e-9)
    try:
        stream.admit(batch, 0)
        groups = list(stream.groups)
        rollout, metrics, uids = stream.take(4, 0)
    finally:
        stream.close()
    samples = [s for g in groups for s in g.samples]
    assert len(uids) == 4 and all(s.done for s in samples)
    assert [s.segments for s in samples] == [len(s.token_ids) for s in samples]  # one token a round, on both replicas
    assert max(len(s.token_ids) for s in samples) > 1
    assert metrics["stream/partial_sample_frac"] == pytest.approx(sum(len(s.token_ids) > 1 for s in samples) / 8)
    sampling = SamplingConfig(n=2, max_tokens=12, seed=3)
    pool.stop_at(time.monotonic() + 3600.0)
    try:
        far = pool.generate(PROMPTS, sampling)
    finally:
        pool.stop_at(None)
    whole = pool.generate(PROMPTS, sampling)
    assert [[c.token_ids for c in per] for per in far] == [[c.token_ids for c in per] for per in whole]
    assert max(len(c.token_ids) for per in whole for c in per) > 1


def test_fit_on_ray_replicas_with_in_flight_updates_and_a_budget_in_seconds(pool, toy_task, tmp_path):
    """``arctic-rl fit`` with the stream, ``in_flight_weight_updates`` and ``partial_rollout_seconds`` on two transformers
    replicas of its own (one per node, beside the module's pool): the callback takes the pool as it takes an in-process
    engine, the weights of each step are pushed while the next round decodes, and every trained token is within
    ``max_staleness``."""
    from arctic_rl.cli import build_cli
    from tests.helpers import quickstart_config, write_config
    from tests.rollout.test_overlap import logged_rows

    changes = {"trainer.max_steps": 3, "data.init_args.batch_size": 4, "model.init_args.sampling.group_size": 4,
               "model.init_args.optim.warmup_steps": 0, "trainer.enable_checkpointing": False}
    config = quickstart_config(toy_task, tmp_path, **changes)
    config["trainer"]["callbacks"] = [{"class_path": "arctic_rl.RolloutCallback", "init_args": {
        "engine": "transformers", "max_staleness": 2, "partial_rollout_tokens": 4, "rounds_per_step": None,
        "in_flight_weight_updates": True, "partial_rollout_seconds": 0.05, "log_samples_every_n_steps": 0,
        "ray": {"num_engines": 2, "num_cpus_per_engine": 1, "placement_strategy": "SPREAD", "timeout_s": 120}}}]
    cli = build_cli(["--config", str(write_config(config, tmp_path / "ray_in_flight.yaml"))], run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rows = logged_rows(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(r["rollout/staleness"] <= 2 for r in rows)
    assert all(r["timing/sync_s"] > 0 for r in rows[:-1])


@pytest.mark.timeout(600)
def test_a_replica_killed_mid_round_fails_the_round_naming_it(pool, tiny_model_dir, toy_task):
    """Replica 1's process is killed while its decode waits at a step boundary: the stream's round ends with the pool's
    error naming the replica and its node (the stream's own time limit, far off, would say otherwise)."""
    from arctic_rl.rollout.stream.stream import RolloutStream, StreamError

    module, [batch] = toy_stream_inputs(tiny_model_dir, toy_task, 1)
    stream = RolloutStream(pool, module, max_staleness=2, budget=7, steps_per_batch=1, weights_step=0, round_timeout_s=HOLD_S)
    pid, place = pool.replicas()[1]["pid"], pool.places[1]
    try:
        hold(pool, 2, [1])
        stream.launch([(batch, 0)], 0)
        wait_at_boundary(pool, [1])
        os.kill(pid, signal.SIGKILL)  # the replica's actor process, started by this module's pool
        with pytest.raises(StreamError, match=f"engine replica 1 \\(actor {pool.names[1]} on node {place['ip']} .* died during generate"):
            stream.finish()
    finally:
        stream.close()
