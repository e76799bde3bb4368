"""Training ranks as Ray actors (``training.launcher: ray``) on a real 2-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``, two CPUs per node): a client GRPO loop on 1 rank x 2 nodes (placement ``SPREAD``: one
rank per node; DeepSpeed ZeRO-2 over gloo, the transformers engine on rank 0) equals the same loop on 1 rank in one
process (``test_ranks.py``'s loop and tolerances); a rank whose actor is killed (placement ``PACK``, the default: both
ranks on one node) ends the job with ``JobFailed`` naming the rank and its node, and leaves no actor, process or
reserved resource behind. One cluster for the module, shut down after it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import JobFailed
from tests.ray_nodes import local_ray_nodes
from tests.serve.conftest import client_config
from tests.serve.test_ranks import assert_same_run, one_rank, run_loop  # noqa: F401  (one_rank: the 1-rank run)

GONE_WAIT_S = 120.0  # Ray kills an actor's process asynchronously: how long a stopped rank may take to be gone


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of two CPUs each (their workers import this checkout through PYTHONPATH), this process connected;
    shut down after the module."""
    with local_ray_nodes(head_cpus=2, node_cpus=[2], connect=True) as nodes:
        yield nodes


def ray_config(model_dir, root, address: str, strategy: str = "PACK", **changes) -> dict:
    training = {"devices": 1, "num_nodes": 2, "zero_stage": 2, "launcher": "ray"}
    return client_config(model_dir, root, training=training, engines={"engine": "transformers"},
                         ray={"address": address, "placement_strategy": strategy}, **changes)


def node_addresses() -> dict[str, str]:
    """The cluster's live nodes: node id -> IP."""
    import ray

    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}


def assert_all_released(pids: list[int]) -> None:
    """Every rank's process is gone and the cluster has all its CPUs free again (no actor or placement group holds one)."""
    import ray

    deadline = time.monotonic() + GONE_WAIT_S
    while time.monotonic() < deadline and (any(alive(pid) for pid in pids)
                                           or ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"]):
        time.sleep(0.5)
    assert [pid for pid in pids if alive(pid)] == []
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"] == 4.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("protocol", ["local", "http"])
def test_one_rank_on_each_of_two_nodes_equals_one_rank(protocol, one_rank, cluster, tiny_model_dir, tmp_path):  # noqa: F811
    with ArcticRLClient(ray_config(tiny_model_dir, tmp_path, cluster.address, "SPREAD", protocol=protocol)) as client:
        status = client.status()
        assert status["world_size"] == 2
        assert len(set(status["rank_nodes"])) == 2 and set(status["rank_nodes"]) == set(node_addresses())  # one per node
        got = run_loop(client, tmp_path)
    assert_same_run(got, one_rank)
    assert_all_released(status["rank_pids"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_rank_actor_ends_the_job_naming_the_rank_and_its_node(cluster, tiny_model_dir, tmp_path):
    with ArcticRLClient(ray_config(tiny_model_dir, tmp_path, cluster.address)) as client:
        status = client.status()
        pids, nodes = status["rank_pids"], status["rank_nodes"]
        assert len(set(nodes)) == 1  # PACK: both bundles fit on one node's 2 CPUs
        batch = TrainBatch.build([[1, 2], [1, 3]], [[3, 4], [5, 6]], [1.0, -1.0])
        client.forward_backward(batch, "dapo")
        os.kill(pids[1], signal.SIGKILL)  # rank 1's actor process, which this test's client started
        with pytest.raises(JobFailed) as failed:
            client.forward_backward(batch, "dapo")
        ip = node_addresses()[nodes[1]]
        assert str(failed.value).startswith(
            f"the training job was ended: training rank 1 on node {ip} ({nodes[1][:12]}) died during forward_backward "
            "(its actor died"), str(failed.value)
        with pytest.raises(JobFailed, match="training rank 1 on node"):  # every later call: the same error
            client.status()
    assert_all_released(pids)
