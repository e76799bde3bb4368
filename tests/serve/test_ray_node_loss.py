"""A node lost between steps (``training.launcher: ray`` on a real 3-node Ray cluster on this machine: a head without
CPUs and two nodes of two CPUs, ranks placed ``STRICT_SPREAD``, one per node): the next call is ``JobFailed`` naming
the rank and its node, every later call says the same, and a ``save_state`` written before the loss loads into a job on
a fresh cluster, which then takes the step the lost job took after saving with the same result (weights and
optimizer state both restored)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import JobFailed
from tests.ray_nodes import local_ray_nodes
from tests.serve.conftest import client_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
BATCH = TrainBatch.build([[5, 9], [5, 9], [6, 12], [6, 12]], [[3, 4], [5, 6, 7], [8], [9, 10]], [1.0, -1.0, 0.5, -0.5])


@contextmanager
def three_node_cluster():
    """A head node with no CPUs (no rank lands there, so losing a rank's node never takes the head) and two nodes of
    two CPUs; this process connected. Everything is shut down at exit."""
    with local_ray_nodes(head_cpus=0, node_cpus=[2, 2], connect=True) as nodes:
        yield nodes


def spread_config(model_dir, root, address: str) -> dict:
    return client_config(model_dir, root, training={"devices": 1, "num_nodes": 2, "zero_stage": 2, "launcher": "ray"},
                         engines={"engine": "transformers"}, ray={"address": address, "placement_strategy": "STRICT_SPREAD"})


def test_a_lost_node_ends_the_job_naming_its_rank_and_the_saved_state_loads_on_a_fresh_cluster(tiny_model_dir, tmp_path):
    import ray

    with three_node_cluster() as nodes, ArcticRLClient(spread_config(tiny_model_dir, tmp_path, nodes.address)) as client:
        status = client.status()
        rank_nodes = status["rank_nodes"]
        assert len(set(rank_nodes)) == 2  # one rank per node
        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        client.forward_backward(BATCH, "dapo")
        client.optim_step()
        assert client.save_state("states/s1")["step"] == 1
        saved = client.forward(BATCH)["logprobs"]
        client.forward_backward(BATCH, "dapo")
        assert client.optim_step()["step"] == 2
        after_step = client.forward(BATCH)["logprobs"]
        assert not torch.allclose(after_step, saved)

        [lost] = [node for node in nodes.worker_nodes if node.node_id == rank_nodes[1]]
        nodes.remove_node(lost)  # rank 1's node goes away between steps, its raylet and actor processes with it
        with pytest.raises(JobFailed) as failed:
            client.forward_backward(BATCH, "dapo")
        assert str(failed.value).startswith(
            f"the training job was ended: training rank 1 on node {ips[rank_nodes[1]]} ({rank_nodes[1][:12]}) died"), str(failed.value)
        with pytest.raises(JobFailed, match=r"training rank 1 on node"):  # every later call: the same error
            client.status()

    with three_node_cluster() as fresh, ArcticRLClient(spread_config(tiny_model_dir, tmp_path, fresh.address)) as client:
        assert client.status()["step"] == 0
        assert client.load_state("states/s1")["step"] == 1
        torch.testing.assert_close(client.forward(BATCH)["logprobs"], saved, rtol=0, atol=1e-7)
        client.forward_backward(BATCH, "dapo")
        assert client.optim_step()["step"] == 2  # the Adam moments came back too: the same step as the lost job's
        torch.testing.assert_close(client.forward(BATCH)["logprobs"], after_step, rtol=0, atol=1e-7)
