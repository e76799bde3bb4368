"""The Ray transport end to end: the fake handler in a ServiceActor on a real local Ray cluster, via RayTransport."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from arctic_rl.serve.errors import JobFailed, RequestError, ServiceError, ServiceTimeout, UnknownOperation
from arctic_rl.serve.transports.ray_actor import RayTransport
from arctic_rl.serve.transport import Message
from tests.serve.fake_handler import FACTORY, REPO
from tests.serve.wire_samples import assert_same_tensors, every_dtype

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    """One local Ray cluster for the module (its workers import ``tests.serve`` through PYTHONPATH)."""
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pythonpath) if p)
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()
    if pythonpath is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = pythonpath


@pytest.fixture(scope="module")
def transport(cluster):
    transport = RayTransport({}, factory=FACTORY, num_cpus=0, call_timeout_s=30, startup_timeout_s=60)
    yield transport
    transport.close()


def test_every_dtype_round_trips(transport):
    meta = {"prompts": ["a"], "nested": {"n": [1, None]}}
    reply = transport.call("echo", Message(meta, every_dtype()))
    assert reply.meta == meta
    assert_same_tensors(reply.tensors, {name: t + t for name, t in every_dtype().items()})


def test_errors_come_back_as_their_class(transport):
    with pytest.raises(RequestError, match="fail was asked to fail"):
        transport.call("fail", Message())
    with pytest.raises(ServiceError, match="^RuntimeError: crash was asked to crash$"):
        transport.call("crash", Message())
    with pytest.raises(UnknownOperation, match="no op 'sample'"):
        transport.call("sample", Message())
    with pytest.raises(ServiceTimeout, match="'slow' got no answer"):
        transport.call("slow", Message({"seconds": 1.0}), timeout_s=0.2)
    assert transport.call("echo", Message({"k": 1})).meta == {"k": 1}


def test_an_actor_killed_mid_call_raises_job_failed_and_ray_stays_up(cluster):
    transport = RayTransport({}, factory=FACTORY, num_cpus=0, call_timeout_s=30, startup_timeout_s=60)
    kill = threading.Timer(0.5, ray.kill, args=(transport.actor,))
    kill.start()
    try:
        with pytest.raises(JobFailed, match="the service actor died during 'slow'"):
            transport.call("slow", Message({"seconds": 20}))
        with pytest.raises(JobFailed):
            transport.call("echo", Message({}, {"x": torch.ones(1)}))
    finally:
        kill.cancel()
        transport.close()
    assert ray.is_initialized()  # the transport joined this cluster: it does not shut it down


def test_a_factory_that_raises_fails_the_start_with_its_reason(cluster):
    with pytest.raises(JobFailed, match="(?s)failed to start.*EchoHandler refused to build: testing"):
        RayTransport({"refuse": "testing"}, factory=FACTORY, num_cpus=0, startup_timeout_s=60)
