"""A non-finite update never reaches the service's weights, through either front door:

- the client API (the in-process client over plain torch; a real HTTP server over DeepSpeed ZeRO-2): a learning
  rate that is not finite or not > 0 is refused before any work; a ``forward_backward`` whose loss is finite but
  whose gradient is not (a registered loss, ``nonfinite_loss.py``) makes the next ``optim_step`` a skipped step,
  reported (``step_skipped``, the infinite ``grad_norm`` readable over the wire), with the log-probs unchanged;
- the Tinker API (a real server, the real ``tinker`` SDK, raw HTTP where the SDK cannot send the value):
  ``adam_params.learning_rate: Infinity`` is refused with the weights untouched, and sampler log-probs far below
  the policy's (a finite loss, a gradient whose norm overflows) give a skipped step whose ``retrieve_future``
  answer is 200, its infinite ``grad_norm`` written ``"Infinity"``, read back by the SDK as ``inf``.
"""

from __future__ import annotations

import json
import math
import os
import secrets

import httpx
import pytest
import torch

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.server import start_server_process
from tests.helpers import REPO
from tests.serve.conftest import client_config

FACTORY = "tests.serve.nonfinite_loss:build"  # a string: importing the module registers its loss, so only the jobs do
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [[3, 14, 9, 15, 21], [3, 16, 8, 21]]  # token ids of the toy vocabulary
RESPONSES = [[5, 6, 7, 8], [9, 10, 11]]


def batch() -> TrainBatch:
    return TrainBatch.build(PROMPTS, RESPONSES, torch.tensor([1.0, -1.0]))


@pytest.fixture(scope="module", params=["local", "http-zero2"])
def client(request, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "local":
        import tests.serve.nonfinite_loss  # noqa: F401  (registers infinite_gradient in this process, the job's)

        try:
            with ArcticRLClient(client_config(tiny_model_dir, root, engines={"engine": "transformers"})) as c:
                yield c
        finally:  # the loss leaves this process's registry with the module's job, so later tests see the built-ins only
            from arctic_rl.loss_registry import LOSSES

            LOSSES.pop("infinite_gradient", None)
        return
    config = client_config(tiny_model_dir, root, engines={"engine": "transformers"}, training={"zero_stage": 2})
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    server = start_server_process(config, handler=FACTORY, env={"PYTHONPATH": pythonpath}, startup_timeout_s=600,
                                  log_file=root / "server.log")
    try:
        with ArcticRLClient(protocol="http", server_url=server.url, auth_token=server.token,
                            timeouts={"call_s": 300.0}) as c:
            yield c
    finally:
        server.stop()


@pytest.mark.parametrize("lr, message", [(math.inf, "lr must be a finite number, got inf"),
                                         (math.nan, "lr must be a finite number, got nan"),
                                         (0.0, "lr must be > 0, got 0.0"), (-1e-3, "lr must be > 0, got -0.001")])
def test_a_learning_rate_not_finite_or_not_positive_is_refused_with_the_weights_kept(client, lr, message):
    before = client.forward(batch())["logprobs"]
    step = client.status()["step"]
    client.forward_backward(batch(), "dapo")
    with pytest.raises(RequestError) as refused:
        client.optim_step(lr=lr)
    # over HTTP the client's own wire check refuses a non-finite one before sending (meta.lr); the server, the rest
    assert message in str(refused.value) or (not math.isfinite(lr) and f"meta.lr is {lr}" in str(refused.value))
    assert client.status()["step"] == step
    torch.testing.assert_close(client.forward(batch())["logprobs"], before, rtol=0, atol=0)
    client.zero_grad()


def test_a_non_finite_gradient_makes_a_skipped_reported_step_with_the_weights_kept(client):
    before = client.forward(batch())["logprobs"]
    step = client.status()["step"]
    loss = client.forward_backward(batch(), "infinite_gradient")["loss"]
    assert math.isfinite(loss)  # the loss is finite: only the gradient is not
    out = client.optim_step()
    assert out["step_skipped"] is True and not math.isfinite(out["grad_norm"]) and out["step"] == step + 1
    torch.testing.assert_close(client.forward(batch())["logprobs"], before, rtol=0, atol=0)
    client.forward_backward(batch(), "dapo")  # the next finite step trains, from the kept weights
    out = client.optim_step()
    assert out["step_skipped"] is False and math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    after = client.forward(batch())["logprobs"]
    assert torch.isfinite(after).all() and not torch.equal(after, before)


# ---------------------------------------------------------------------------------------------- the Tinker API
@pytest.fixture(scope="module")
def tinker_server(tmp_path_factory):
    from arctic_rl.tasks.toy import write_tiny_model

    root = tmp_path_factory.mktemp("tinker-nonfinite")
    model = write_tiny_model(root / "model", seed=0)
    config = {"model": str(model),
              "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 1e-3, "max_grad_norm": 1.0},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 48},
              "server": {"root_dir": str(root / "root")}}
    proc = start_server_process(config, api="tinker", token=f"tml-{secrets.token_urlsafe(16)}", startup_timeout_s=300)
    try:
        with tinker.ServiceClient(base_url=proc.url, api_key=proc.token) as service:  # closed before the server stops
            proc.training = service.create_lora_training_client(base_model=str(model), rank=0).result()
            yield proc
    finally:
        proc.stop()


def datums(sampler_logprob: float) -> list:
    """Each prompt + response shifted by one; advantage 1 and the sampler's log-prob on the response's targets."""
    out = []
    for prompt, response in zip(PROMPTS, RESPONSES):
        full, p = prompt + response, len(prompt) - 1
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:], "advantages": [0.0] * p + [1.0] * len(response),
            "logprobs": [0.0] * p + [sampler_logprob] * len(response)}))
    return out


def tinker_logprobs(training) -> list[list[float]]:
    result = training.forward(datums(-3.0), "importance_sampling").result()
    return [out["logprobs"].tolist() for out in result.loss_fn_outputs]


def raw_call(server, route: str, body: str) -> httpx.Response:
    """POST a queued Tinker route with a raw JSON ``body`` (``Infinity`` is a token the SDK's models refuse to
    send), then ``retrieve_future`` its answer."""
    headers = {"x-api-key": server.token, "content-type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=120) as http:
        queued = http.post(f"/api/v1/{route}", content=body)
        assert queued.status_code == 200, queued.text
        return http.post("/api/v1/retrieve_future", json={"request_id": queued.json()["request_id"]})


def test_tinker_an_infinite_learning_rate_is_refused_with_the_weights_kept(tinker_server):
    training = tinker_server.training
    before = tinker_logprobs(training)
    training.forward_backward(datums(-3.0), "importance_sampling").result()  # a finite gradient waits for the step
    body = '{"model_id": %s, "adam_params": {"learning_rate": Infinity}}' % json.dumps(training.model_id)
    answer = raw_call(tinker_server, "optim_step", body)
    assert answer.status_code == 200 and answer.json()["category"] == "user", answer.text
    error = answer.json()["error"]  # the core's refusal, or the Tinker layer's naming learning_rate
    assert "lr must be a finite number, got inf" in error or ("learning_rate" in error and "finite" in error), error
    assert tinker_logprobs(training) == before
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # the waiting gradient, applied


def test_tinker_a_non_finite_gradient_is_a_skipped_step_whose_result_renders(tinker_server):
    training = tinker_server.training
    before = tinker_logprobs(training)
    # the sampler's log-probs far below the policy's: exp(-3 + 80) x 1 is a finite loss; its gradient's norm overflows
    fb = training.forward_backward(datums(-80.0), "importance_sampling").result()
    assert math.isfinite(fb.metrics["loss:sum"]) and fb.metrics["loss:sum"] < -1e30
    metrics = training.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics  # the SDK reads "Infinity"
    assert metrics["step_skipped"] == 1.0 and metrics["grad_norm"] == math.inf, metrics
    assert tinker_logprobs(training) == before
    training.forward_backward(datums(-80.0), "importance_sampling").result()
    answer = raw_call(tinker_server, "optim_step", json.dumps({"model_id": training.model_id,
                                                               "adam_params": {"learning_rate": 1e-3}}))
    assert answer.status_code == 200 and answer.json()["metrics"]["grad_norm"] == "Infinity", answer.text
    assert answer.json()["metrics"]["step_skipped"] == 1.0
    assert tinker_logprobs(training) == before
