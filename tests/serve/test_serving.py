"""Endpoint in-process: one op at a time, deadlines for queued calls, refusals before the handler sees a call."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from arctic_rl.serve import wire
from arctic_rl.serve.errors import RequestError, ServiceError, ServiceTimeout
from arctic_rl.serve.factory import build_handler, load_factory
from arctic_rl.serve.transports.serving import Endpoint
from arctic_rl.serve.transport import Message
from tests.serve.fake_handler import EchoHandler


def request(op: str, meta: dict | None = None, timeout_s: float | None = None, **tensors) -> bytes:
    return wire.encode(wire.Frame(op, Message(meta or {}, tensors), timeout_s=timeout_s))


def calls(endpoint: Endpoint) -> int:
    return wire.open_reply(endpoint.answer("count", request("count")), "count").meta["calls"]


class RecordingHandler:
    """Remembers the timeout each call got; ``bad_reply`` answers a dtype the wire does not carry."""

    def __init__(self):
        self.timeouts = []

    def call(self, op, request, timeout_s=None):
        self.timeouts.append(timeout_s)
        return Message({}, {"z": torch.zeros(1, dtype=torch.complex64)}) if op == "bad_reply" else Message()

    def close(self):
        pass


def test_answers_with_the_handlers_reply():
    endpoint = Endpoint(EchoHandler({}), max_request_bytes=1 << 20)
    reply = wire.open_reply(endpoint.answer("echo", request("echo", {"k": "v"}, x=torch.ones(2))), "echo")
    assert reply.meta == {"k": "v"} and torch.equal(reply.tensors["x"], torch.full((2,), 2.0))


def test_refusals_never_reach_the_handler():
    endpoint = Endpoint(EchoHandler({}), max_request_bytes=200)
    with pytest.raises(RequestError, match="request for 'echo' but was sent to 'optim_step'"):
        endpoint.answer("optim_step", request("echo"))
    with pytest.raises(RequestError, match="must not carry an error"):
        endpoint.answer("echo", wire.error_body("echo", RequestError("x")))
    with pytest.raises(RequestError, match="over the limit of 200 bytes"):
        endpoint.answer("echo", request("echo", x=torch.ones(100)))
    assert calls(endpoint) == 0


def test_a_queued_call_expires_at_its_deadline_without_running():
    handler = EchoHandler({})
    endpoint = Endpoint(handler, max_request_bytes=1 << 20)
    slow = threading.Thread(target=endpoint.answer, args=("slow", request("slow", {"seconds": 1.0})))
    slow.start()
    while handler.calls == 0:  # until the slow call runs, holding the lock
        time.sleep(0.01)
    with pytest.raises(ServiceTimeout, match="'echo' did not start: it waited its timeout of 0.2 s"):
        endpoint.answer("echo", request("echo", timeout_s=0.2))
    slow.join()
    assert calls(endpoint) == 1


def test_the_handler_gets_the_shorter_of_request_and_server_timeouts():
    handler = RecordingHandler()
    Endpoint(handler, max_request_bytes=1 << 20, call_timeout_s=5.0).answer("a", request("a", timeout_s=60.0))
    Endpoint(handler, max_request_bytes=1 << 20, call_timeout_s=60.0).answer("a", request("a", timeout_s=5.0))
    Endpoint(handler, max_request_bytes=1 << 20).answer("a", request("a"))
    assert [t is not None and 4.0 < t <= 5.0 for t in handler.timeouts[:2]] == [True, True]
    assert handler.timeouts[2] is None


def test_a_reply_the_wire_cannot_carry_is_a_server_error_not_the_callers():
    endpoint = Endpoint(RecordingHandler(), max_request_bytes=1 << 20)
    with pytest.raises(ServiceError, match="the reply of 'bad_reply' cannot be sent") as caught:
        endpoint.answer("bad_reply", request("bad_reply"))
    assert not isinstance(caught.value, RequestError)


@pytest.mark.parametrize(("path", "error", "reason"), [
    ("tests.serve.fake_handler", ValueError, "written 'package.module:function'"),
    ("tests.serve.fake_handler:nope", ValueError, "has no function 'nope'"),
    ("tests.serve.no_such_module:build", ImportError, "cannot import the handler factory"),
])
def test_factory_paths_fail_clearly(path, error, reason):
    with pytest.raises(error, match=reason):
        load_factory(path)


def test_factory_gets_the_config_dict():
    handler = build_handler("tests.serve.fake_handler:build", {"lr": 1e-6})
    assert isinstance(handler, EchoHandler) and handler.config == {"lr": 1e-6}
