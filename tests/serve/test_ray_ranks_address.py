"""Rank actors (``training.launcher: ray``) with no Ray cluster at ``ray.address``: the first call fails at once with
one line saying how to start one, before any rank, actor or Ray runtime is started (a real client; nothing listens on
the port)."""

from __future__ import annotations

import pytest

from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.core import ServiceCore
from arctic_rl.serve.errors import JobFailed
from arctic_rl.serve.ranks.actors import no_cluster_text
from arctic_rl.serve.ranks.ranked import RankedCore, make_core
from arctic_rl.weight_sync.broadcast import free_port
from tests.serve.conftest import client_config


def test_no_cluster_at_the_address_is_one_line_saying_how_to_start_one(tiny_model_dir, tmp_path):
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    port = free_port()  # nothing listens on it
    config = client_config(tiny_model_dir, tmp_path, training={"devices": 1, "num_nodes": 2, "zero_stage": 2, "launcher": "ray"},
                           engines={"engine": "transformers"}, ray={"address": f"127.0.0.1:{port}"},
                           timeouts={"connect_s": 5})
    with ArcticRLClient(config) as client:
        with pytest.raises(JobFailed) as failed:
            client.status()
        with pytest.raises(JobFailed, match="no Ray cluster reachable"):  # the next call tries again, fails the same way
            client.status()
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"no Ray cluster reachable at ray.address='127.0.0.1:{port}' (")
    assert message.endswith(f"); start one with `ray start --head --port={port}` on the head node (and `ray start "
                            f"--address=<head ip>:{port}` on every other node), or set ray.address to a running one")
    assert not ray.is_initialized()  # nothing of Ray was started


def test_the_line_for_auto_and_for_a_ray_client_address():
    assert no_cluster_text("auto", "none found") == (
        "no Ray cluster reachable at ray.address='auto' (none found); start one with `ray start --head` on the head node "
        "(and `ray start --address=<head ip>:6379` on every other node), or set ray.address to a running one")
    assert "start one with `ray start --head --ray-client-server-port=10001` on the head node (and `ray start " \
           "--address=<head ip>:6379`" in no_cluster_text("ray://10.0.0.2:10001", "refused")


def test_launcher_ray_places_even_one_rank_on_the_cluster():
    one = {"model": "m", "training": {"accelerator": "cpu"}}
    assert type(make_core(ArcticRLClientConfig.load(one))) is ServiceCore  # nothing started: the core starts on its first call
    assert type(make_core(ArcticRLClientConfig.load(one, training={"launcher": "ray"}))) is RankedCore
