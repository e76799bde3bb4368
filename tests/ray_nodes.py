"""A real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``) for the cluster tests: a head node
and worker nodes with their own CPU resources, the nodes' workers importing this checkout (``PYTHONPATH``), and
everything shut down on exit."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = str(Path(__file__).resolve().parents[1])


@contextmanager
def local_ray_nodes(head_cpus: int, node_cpus: Sequence[int], connect: bool) -> Iterator:
    """Yield a ``Cluster`` of a head with ``head_cpus`` CPUs and one node per ``node_cpus`` entry. ``connect``: this
    process joins it (``ray.init(address=...)``); otherwise only the runs it starts do (through its ``address``)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, pythonpath) if p)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
    try:
        for cpus in node_cpus:
            nodes.add_node(num_cpus=cpus)
        nodes.wait_for_nodes()
        if connect:
            ray.init(address=nodes.address)
        yield nodes
    finally:
        if connect:
            ray.shutdown()
        nodes.shutdown()
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
