"""The real service over HTTP: ``arctic-rl serve`` of the training core (vLLM engine, Lightning run) in a
subprocess on loopback. Fuzzed requests are refused with a 4xx and leave the job as it was; strangers are
refused; concurrent clients each get their own right answers; a killed server is an error, not a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arctic_rl.serve import wire
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import AuthError, JobFailed
from arctic_rl.serve.transport import Message
from tests.serve.conftest import client_config
from tests.serve.test_core_requests import PROMPTS, G, sampled_batch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tiny_model_dir, tmp_path_factory):
    """An embedded server (the client starts ``arctic-rl serve``'s server process and stops it on close)."""
    config = client_config(tiny_model_dir, tmp_path_factory.mktemp("root"), protocol="http",
                           timeouts={"call_s": 60.0, "startup_s": 300.0})
    with ArcticRLClient(config) as client:
        client.status()  # started
        yield client


def fingerprint(client: ArcticRLClient) -> torch.Tensor:
    batch = TrainBatch.build([PROMPTS[0]] * 2, [[9, 10, 11], [12]], [1.0, -1.0])
    return client.forward(batch)["logprobs"]


def post(client: ArcticRLClient, op: str, body: bytes, token: str | None = None) -> httpx.Response:
    server = client._server
    headers = {"content-type": wire.CONTENT_TYPE, "authorization": f"Bearer {token or server.token}"}
    return httpx.post(f"{server.url}/v1/ops/{op}", content=body, headers=headers, timeout=60)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                           max_leaves=12)
FIELDS = ["prompts", "n", "max_tokens", "temperature", "seed", "prompt_seeds", "processors", "loss", "loss_config", "lr", "path"]
metas = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=4)
TENSOR_NAMES = ["prompt_ids", "prompt_lengths", "response_ids", "response_mask", "advantages", "old_logprobs", "junk"]
tensors = st.dictionaries(
    st.sampled_from(TENSOR_NAMES),
    st.tuples(st.sampled_from([torch.int64, torch.float32, torch.bool]), st.lists(st.integers(0, 3), min_size=0, max_size=2))
    .map(lambda spec: (torch.randint(-3, 50, spec[1]) if spec[0] != torch.bool else torch.rand(spec[1]) > 0.5).to(spec[0])),
    max_size=5)
OPS = st.sampled_from(["sample", "forward", "forward_backward", "no_such_op", "optim_step"])


def test_fuzzed_requests_are_refused_and_change_nothing(service):
    before, step = fingerprint(service), service.status()["step"]
    answers = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(op=OPS, meta=metas, named=tensors)
    def one(op, meta, named):
        if op == "optim_step" and not set(meta) - {"lr"}:
            meta = {**meta, "bogus": 1}  # a well-formed optim_step would (rightly) step: keep it malformed
        body = wire.encode(wire.Frame(op, Message(meta, named)))
        reply = post(service, op, body)
        answers.append(reply.status_code)
        assert reply.status_code in (200, 400, 403, 404, 413) , reply.text
        if reply.status_code == 200:
            assert op in ("sample", "forward")  # reads, which do not change the job
        else:
            assert set(reply.json()) == {"error", "message"}

    one()
    for garbage in (b"", b"ARLW", os.urandom(64), b"ARLW" + (2**63).to_bytes(8, "little")):
        answers.append(post(service, "forward_backward", garbage).status_code)
        assert 400 <= answers[-1] < 500
    assert sum(a != 200 for a in answers) > 50
    torch.testing.assert_close(fingerprint(service), before, rtol=0, atol=0)
    assert service.status()["step"] == step
    assert service.optim_step()["grad_norm"] == 0.0  # no refused forward_backward left gradients behind


def test_strangers_are_refused(service):
    assert post(service, "status", wire.encode(wire.Frame("status", Message())), token="guess").status_code == 401
    with ArcticRLClient(service.config, server_url=service._server.url, auth_token="guess") as stranger:
        with pytest.raises(AuthError):
            stranger.status()


def test_concurrent_clients_are_each_served_correctly(service):
    batches = [sampled_batch(service, seed=s) for s in range(4)]
    alone = [service.forward(b)["logprobs"] for b in batches]
    results, errors = {}, []

    def worker(i: int) -> None:
        try:
            with ArcticRLClient(service.config, server_url=service._server.url, auth_token=service._server.token) as c:
                for _ in range(3):
                    results.setdefault(i, []).append(c.forward(batches[i])["logprobs"])
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors and not any(t.is_alive() for t in threads)
    for i, answers in results.items():
        assert len(answers) == 3
        for answer in answers:
            torch.testing.assert_close(answer, alone[i], rtol=0, atol=0)


def test_a_killed_server_is_an_error_naming_it(tiny_model_dir, tmp_path):
    """``arctic-rl serve`` (the CLI) started by hand; killed with SIGKILL; the next call fails fast."""
    config = tmp_path / "client.yaml"
    config.write_text(f"model: {tiny_model_dir}\nengines: {{engine: vllm}}\n"
                      f"sampling: {{max_prompt_length: 32, max_response_length: 8}}\n"
                      f"training: {{accelerator: cpu}}\nserver: {{root_dir: {tmp_path / 'root'}}}\n")
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "arctic_rl.cli", "serve", "--config", str(config), "--ready-file", str(ready)],
                            env={**os.environ, "ARCTIC_RL_TOKEN": "t0ken"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import json
        import time

        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        url = json.loads(ready.read_text())["url"]
        with ArcticRLClient(config, protocol="http", server_url=url, auth_token="t0ken",
                            timeouts={"call_s": 30, "connect_s": 5}) as client:
            assert client.sample([PROMPTS[0]], n=G, max_tokens=4, seed=0).token_ids
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            with pytest.raises(JobFailed, match=url.split("//")[1]):
                client.status()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
