"""Bad requests to ``arctic-rl serve`` refused in one line naming the field, before anything runs: a real Tinker
server (the unmodified ``tinker`` SDK, or raw HTTP where the SDK cannot send the bad value) and a real arctic-rl
API server, one of each per module, over the quickstart's tiny Qwen3 (CPU, transformers engine)."""

from __future__ import annotations

import json
import os
import secrets
import time

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from arctic_rl.serve.client import ArcticRLClient  # noqa: E402
from arctic_rl.serve.config import ArcticRLClientConfig  # noqa: E402
from arctic_rl.serve.errors import RequestError  # noqa: E402
from arctic_rl.serve.server import main, start_server_process  # noqa: E402
from tests.serve.conftest import client_config  # noqa: E402
from tests.serve.test_tinker_app import TOKEN, served  # noqa: E402,F401  (the stand-in core's app)

LORA_STATE = "tinker://s-lora:train:0/weights/lora"  # an earlier session's LoRA state under the same root_dir
TOKEN_LIMIT = 4096  # server.max_sample_tokens_per_request of the Tinker server here


@pytest.fixture(scope="module")
def refused_on_the_arctic_api(tmp_path_factory):
    """An arctic-rl API server with LoRA (rank 4): its refusal of a huge sample, and a LoRA state it saved where
    the Tinker server's load_weights finds an earlier session's state."""
    from arctic_rl.tasks.toy import write_tiny_model

    root = tmp_path_factory.mktemp("bad-requests")
    model = write_tiny_model(root / "model", seed=0)
    config = client_config(model, root / "root", engines={"engine": "transformers"}, lora={"rank": 4})
    server = start_server_process(config, startup_timeout_s=600, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    try:
        with ArcticRLClient(protocol="http", server_url=server.url, auth_token=server.token,
                            timeouts={"call_s": 300.0, "startup_s": 600.0}) as client:
            with pytest.raises(RequestError) as refused:
                client.sample([[4, 13, 5, 7, 8]], n=1_000_000, max_tokens=8)
            client.save_state("tinker/s-lora_train_0/weights/lora")
    finally:
        server.stop()
    return {"model": model, "root": root / "root", "sample_refusal": str(refused.value)}


@pytest.fixture(scope="module")
def server(refused_on_the_arctic_api):
    """A Tinker API server without LoRA on the same root_dir, and its training client."""
    earlier = refused_on_the_arctic_api
    config = {"model": str(earlier["model"]),
              "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 1e-3, "max_grad_norm": 1.0},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 48},
              "server": {"root_dir": str(earlier["root"]), "max_sample_tokens_per_request": TOKEN_LIMIT}}
    proc = start_server_process(config, api="tinker", token=f"tml-{secrets.token_urlsafe(16)}", startup_timeout_s=600)
    try:
        with tinker.ServiceClient(base_url=proc.url, api_key=proc.token) as service:  # closed before the server stops
            proc.training = service.create_lora_training_client(base_model=str(earlier["model"]), rank=0).result()
            proc.root = earlier["root"]
            yield proc
    finally:
        proc.stop()


def post(server, route: str, body: dict) -> httpx.Response:
    """Raw JSON (``Infinity`` and ``NaN`` as a JavaScript client writes them; the SDK cannot send them)."""
    return httpx.post(f"{server.url}/api/v1/{route}", content=json.dumps(body),
                      headers={"X-API-Key": server.token, "Content-Type": "application/json"}, timeout=60)


def answer(server, route: str, body: dict) -> dict:
    """A queued request's answer (``retrieve_future``, as the SDK polls it)."""
    reply = post(server, route, body)
    assert reply.status_code == 200, reply.text
    while True:
        result = post(server, "retrieve_future", {"request_id": reply.json()["request_id"]}).json()
        if result.get("type") != "try_again":
            return result
        time.sleep(0.1)


def datum(tokens: list[int], advantage: float = 1.0, logprob: float = -1.0) -> types.Datum:
    """An importance-sampling datum in the next-token layout: ``tokens`` then token 5 as the last target."""
    targets = tokens[1:] + [5]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs={
        "target_tokens": targets, "advantages": [advantage] * len(tokens), "logprobs": [logprob] * len(tokens)})


def logprobs(server) -> list[list[float]]:
    out = server.training.forward([datum([4, 13, 5, 7])], "importance_sampling").result()
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


@pytest.mark.slow
def test_a_huge_sample_is_refused_naming_its_count_on_every_api(refused_on_the_arctic_api, server):
    assert refused_on_the_arctic_api["sample_refusal"] == (
        "n=1000000 x 1 prompts: 1000000 completions, over server.max_samples_per_request=16384; ask for fewer per request")
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [4, 13, 5, 7, 8]}]}
    reply = post(server, "asample", {"prompt": prompt, "num_samples": 1_000_000,
                                     "sampling_params": {"max_tokens": 48, "seed": 1, "stop": [2]}})
    assert reply.status_code == 400 and reply.json() == {"category": "user", "error": (
        "RequestError: num_samples=1000000: 1000000 completions, over server.max_samples_per_request=16384; "
        "ask for fewer per request")}
    reply = post(server, "asample", {"prompt": prompt, "num_samples": 100, "sampling_params": {"max_tokens": 48}})
    assert reply.status_code == 400 and reply.json()["error"] == (
        f"RequestError: num_samples=100 with max_tokens=48: 5300 tokens (completions x (prompt + max_tokens)), over "
        f"server.max_sample_tokens_per_request={TOKEN_LIMIT}; ask for fewer completions or tokens per request")
    sampler = server.training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(prompt=types.ModelInput.from_ints([4, 13, 5, 7, 8]), num_samples=70,
                         sampling_params=types.SamplingParams(max_tokens=48, seed=1)).result()
    assert len(out.sequences) == 70  # 70 x 53 tokens: within the limit


@pytest.mark.slow
@pytest.mark.parametrize("field, value, expected", [
    ("learning_rate", float("inf"), "adam_params.learning_rate must be a finite number > 0, got inf"),
    ("learning_rate", float("nan"), "adam_params.learning_rate must be a finite number > 0, got nan"),
    ("learning_rate", 0.0, "adam_params.learning_rate must be a finite number > 0, got 0.0"),
    ("beta1", 1.0, "adam_params.beta1 must be in [0, 1), got 1.0"),
    ("beta2", float("nan"), "adam_params.beta2 must be in [0, 1), got nan"),
    ("eps", 0.0, "adam_params.eps must be a finite number > 0, got 0.0"),
    ("weight_decay", float("inf"), "adam_params.weight_decay must be a finite number >= 0, got inf"),
    ("grad_clip_norm", -1, "adam_params.grad_clip_norm must be a finite number >= 0 (0: no clipping), got -1"),
])
def test_optim_step_refuses_bad_adam_params_by_their_tinker_name_and_keeps_the_weights(server, field, value, expected):
    before = logprobs(server)
    server.training.forward_backward([datum([4, 13, 5, 7])], "importance_sampling").result()
    result = answer(server, "optim_step", {"model_id": server.training.model_id,
                                           "adam_params": {"learning_rate": 1e-2, field: value}})
    assert result == {"error": f"TinkerInputError: {expected}", "category": "user"}
    assert logprobs(server) == before


@pytest.mark.slow
@pytest.mark.parametrize("advantage, logprob, expected", [
    (3e38, -1.0, r"datum 0: loss_fn_inputs.advantages\[0\] = 3e\+38; inputs this large overflow float32: advantages must "
                 r"be finite, of magnitude at most 1e\+10"),
    (float("nan"), -1.0, r"datum 0: loss_fn_inputs.advantages\[0\] = nan; inputs this large overflow float32"),
    (1.0, 5.0, r"datum 0: loss_fn_inputs.logprobs\[0\] = 5; the sampler's log-probs must be finite and <= 0 "
               r"\(a probability is at most 1\)"),
])
@pytest.mark.parametrize("forward_only", [False, True], ids=["forward_backward", "forward"])
def test_loss_inputs_that_overflow_or_are_no_log_probs_are_refused(server, advantage, logprob, expected, forward_only):
    before = logprobs(server)
    call = server.training.forward if forward_only else server.training.forward_backward
    with pytest.raises(tinker.RequestFailedError, match=expected):
        call([datum([4, 13, 5, 7], advantage, logprob)] * 2, "importance_sampling").result()
    assert logprobs(server) == before


@pytest.mark.slow
def test_forward_refuses_log_probs_whose_loss_overflows_as_forward_backward_does(server):
    bad = [datum([4, 13, 5, 7], 1.0, -1000.0)]
    for call in (server.training.forward_backward, server.training.forward):
        with pytest.raises(tinker.RequestFailedError, match="inputs this large overflow float32"):
            call(bad, "importance_sampling").result()


@pytest.mark.slow
def test_tokens_outside_the_vocabulary_name_the_datum_and_the_tinker_field(server):
    good = datum([4, 13, 5, 7])
    two_chunks = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[4, 13]), types.EncodedTextChunk(tokens=[5, -1])])
    negative = types.Datum(model_input=two_chunks, loss_fn_inputs={"target_tokens": [13, 5, -1, 5], "advantages": [1.0] * 4,
                                                                   "logprobs": [-1.0] * 4})
    with pytest.raises(tinker.RequestFailedError, match=r"datum 3: model_input.chunks\[1\].tokens\[1\] = -1 is outside the "
                                                        r"model's vocabulary \[0, \d+\)"):
        server.training.forward_backward([good, good, good, negative], "importance_sampling").result()
    huge = datum([4, 13, 5, 7])
    huge.loss_fn_inputs["target_tokens"] = types.TensorData(data=[13, 5, 7, 10**6], dtype="int64", shape=[4])
    with pytest.raises(tinker.RequestFailedError, match=r"datum 1: loss_fn_inputs.target_tokens\[3\] = 1000000 is outside"):
        server.training.forward([good, huge], "importance_sampling").result()


@pytest.mark.slow
def test_create_model_needs_a_plain_session_id(server):
    for body, shown in (({}, "None"), ({"session_id": "../../../../x"}, "'../../../../x'")):
        reply = post(server, "create_model", {"base_model": None, "lora_config": {"rank": 0}, **body})
        assert reply.status_code == 400 and reply.json() == {"category": "user", "error": (
            "TinkerInputError: create_model: session_id must be a name of letters, digits and _.- (as create_session "
            f"answers), got {shown}")}


@pytest.mark.slow
def test_save_weights_path_must_be_a_string(server):
    result = answer(server, "save_weights", {"model_id": server.training.model_id, "path": {"a": 1}})
    assert result == {"category": "user", "error": "TinkerInputError: save_weights: path must be a string (the checkpoint's "
                                                   "name), got {'a': 1}"}
    assert not list(server.root.glob("tinker/*/weights/{*"))


@pytest.mark.slow
def test_a_lora_state_does_not_load_into_a_server_without_lora(server):
    before = logprobs(server)
    with pytest.raises(tinker.RequestFailedError) as refused:
        server.training.load_state_with_optimizer(LORA_STATE).result()
    assert ("RequestError: path 'tinker/s-lora_train_0/weights/lora' holds LoRA adapters of rank 4 (lora.rank=4); this job "
            "trains all weights (no LoRA) (lora.rank=0): load it into a server started with lora.rank: 4 for") in str(refused.value)
    assert logprobs(server) == before


def test_concurrent_samples_are_batched_within_the_limits(served, tiny_model_dir):
    """Over the stand-in core of test_tinker_app (it records each engine call): 8 requests of 2 x (2 + 3) tokens
    that could run as one call run as calls of at most 2 requests, the most that fit 25 tokens."""
    url, core = served
    core.config = ArcticRLClientConfig.load(core.config, server={"max_sample_tokens_per_request": 25})
    with tinker.ServiceClient(base_url=url, api_key=TOKEN) as service:
        sampler = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints([1, 5 + i]), num_samples=2,
                                  sampling_params=types.SamplingParams(max_tokens=3, seed=i)) for i in range(8)]
        assert [[s.tokens for s in f.result().sequences] for f in futures] == [[[5 + i] * 3] * 2 for i in range(8)]
    assert sorted(p[-1] for call in core.calls for p in call["prompts"]) == [5 + i for i in range(8)]
    assert max(len(call["prompts"]) for call in core.calls) <= 2, core.calls


def test_api_tinker_refuses_a_token_the_sdk_cannot_send(capsys):
    assert main(["--api", "tinker", "--auth-token", "secret", "--port", "0"]) == 2
    assert capsys.readouterr().err == ("arctic-rl serve: --api tinker: the auth token must start with 'tml-', since the "
                                       "tinker SDK refuses any other API key and no client could connect; e.g. "
                                       "--auth-token tml-$(openssl rand -hex 16)\n")
