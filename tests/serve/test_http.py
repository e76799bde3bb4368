"""The HTTP transport end to end: a real uvicorn server process running the fake handler, driven by HttpTransport."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import torch
from hypothesis import given, settings

from arctic_rl.serve import wire
from arctic_rl.serve.errors import (AuthError, JobFailed, PayloadTooLarge, RequestError, ServiceError,
                                    ServiceTimeout, UnknownOperation)
from arctic_rl.serve.transports.http_client import HttpTransport
from arctic_rl.serve.transport import Message
from tests.serve.fake_handler import start_fake_server
from tests.serve.wire_samples import VALID_BODY, assert_same_tensors, every_dtype, mutated_bodies

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server():
    server = start_fake_server(max_request_bytes=LIMIT)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    client = HttpTransport(server.url, auth_token=server.token, call_timeout_s=30)
    yield client
    client.close()


def http(server, token: str | None = "server's") -> httpx.Client:
    """A plain httpx client (``token="server's"``: the server's token; None: no Authorization header)."""
    token = server.token if token == "server's" else token
    headers = {"content-type": wire.CONTENT_TYPE} | ({"authorization": f"Bearer {token}"} if token else {})
    return httpx.Client(base_url=server.url, headers=headers, timeout=30)


def calls(client: HttpTransport) -> int:
    return client.call("count", Message()).meta["calls"]


def test_every_dtype_and_empty_tensors_round_trip(client):
    meta = {"prompts": ["a", "b"], "nested": {"n": [1, 2.5, None, True]}}
    reply = client.call("echo", Message(meta, every_dtype()))
    assert reply.meta == meta
    assert_same_tensors(reply.tensors, {name: t + t for name, t in every_dtype().items()})
    assert client.call("echo", Message()) == Message()


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_missing_or_wrong_token_is_refused(server, token):
    with HttpTransport(server.url, auth_token=token) as stranger, pytest.raises(AuthError, match="Authorization header|wrong bearer token"):
        stranger.call("echo", Message())
    with http(server, token) as plain:
        assert plain.get("/v1/health").json()["status"] == "ok"  # health needs no token
        assert plain.get("/v1/openapi.json").status_code == 401


def test_openapi_schema_documents_the_op_route(server):
    with http(server) as plain:
        schema = plain.get("/v1/openapi.json").json()
    body = schema["paths"]["/v1/ops/{op}"]["post"]["requestBody"]
    assert wire.CONTENT_TYPE in body["content"] and '"ARLW"' in body["description"]
    assert "/v1/health" in schema["paths"]


def test_a_body_over_the_limit_is_refused_with_413(server, client):
    with http(server) as plain:
        reply = plain.post("/v1/ops/echo", content=b"x" * (4 * LIMIT))
    assert reply.status_code == 413
    assert reply.json() == {"error": "PayloadTooLarge",
                            "message": f"the body is {4 * LIMIT} bytes, over the limit of {LIMIT} bytes"}
    with pytest.raises(PayloadTooLarge, match=f"over the limit of {LIMIT} bytes"):
        client.call("echo", Message({}, {"big": torch.zeros(LIMIT, dtype=torch.uint8)}))


def test_fuzzed_bodies_are_answered_4xx_and_never_reach_the_handler(server, client):
    before = calls(client)
    with http(server) as plain:
        @settings(max_examples=50, deadline=None, database=None)
        @given(mutated_bodies())
        def post(body):  # to another op than the body's, so even a body the mutation left valid is refused
            reply = plain.post("/v1/ops/fuzzed", content=body)
            assert 400 <= reply.status_code < 500, reply.text
            assert reply.json()["error"] in ("RequestError", "PayloadTooLarge")

        post()
    assert calls(client) == before
    assert client.call("echo", Message({"still": "serving"})).meta == {"still": "serving"}


def test_unknown_routes_are_404_and_other_content_types_400(server):
    with http(server) as plain:
        assert plain.get("/v1/nope").status_code == 404
        assert plain.post("/v2/ops/echo", content=b"").status_code == 404
        reply = plain.post("/v1/ops/echo", content=VALID_BODY, headers={"content-type": "application/octet-stream"})
    assert reply.status_code == 400 and "content type must be application/x-arctic-rl" in reply.json()["message"]


def test_handler_errors_come_back_as_their_class_and_the_server_keeps_serving(client):
    with pytest.raises(RequestError, match="fail was asked to fail"):
        client.call("fail", Message())
    with pytest.raises(ServiceError, match="^RuntimeError: crash was asked to crash$") as caught:
        client.call("crash", Message())
    assert type(caught.value) is ServiceError
    with pytest.raises(UnknownOperation, match="no op 'sample'"):
        client.call("sample", Message())
    assert client.call("echo", Message({"k": 1})).meta == {"k": 1}


def test_concurrent_clients_each_get_their_own_answers(server):
    results, errors = {}, []

    def run(worker: int) -> None:
        try:
            with HttpTransport(server.url, auth_token=server.token, call_timeout_s=30) as own:
                for i in range(5):
                    x = torch.arange(4, dtype=torch.int64) + 100 * worker + i
                    reply = own.call("echo", Message({"worker": worker, "i": i}, {"x": x}))
                    results[worker, i] = (reply.meta, torch.equal(reply.tensors["x"], x + x))
        except Exception as e:  # noqa: BLE001  (reported below, from the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == {(w, i): ({"worker": w, "i": i}, True) for w in range(4) for i in range(5)}


def test_health_is_answered_while_a_slow_call_runs(server, client):
    slow = threading.Thread(target=client.call, args=("slow", Message({"seconds": 3.0})))
    slow.start()
    while slow.is_alive():  # until a probe times out in the queue: the slow call holds the handler
        try:
            client.call("count", Message(), timeout_s=0.2)
        except ServiceTimeout:
            break
    with http(server, token=None) as plain:
        health = plain.get("/v1/health")
    assert slow.is_alive() and health.json()["status"] == "ok"
    slow.join()


def test_a_call_longer_than_its_timeout_raises_service_timeout(client):
    with pytest.raises(ServiceTimeout, match="'slow' got no answer"):
        client.call("slow", Message({"seconds": 1.5}), timeout_s=0.3)  # overrides the client's 30 s


def test_a_server_killed_mid_call_raises_job_failed(fake_servers):
    server = fake_servers()
    client = HttpTransport(server.url, auth_token=server.token, call_timeout_s=30)
    kill = threading.Timer(1.0, os.kill, args=(server.pid, signal.SIGKILL))
    kill.start()
    try:
        with pytest.raises(JobFailed, match=f"the server at {server.url}"):
            client.call("slow", Message({"seconds": 20}))
        with pytest.raises(JobFailed):
            client.call("echo", Message())
    finally:
        kill.cancel()
        client.close()
