"""The Tinker routes with the real SDK over a stand-in core (no model, seconds): a step's concurrent samples
reach the engine in one call, each with its own request's seed; unknown routes and bad keys get the SDK's
error shape."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from arctic_rl.rollout.engines.base import Completion  # noqa: E402
from arctic_rl.rollout.engines.seeds import mix_seed  # noqa: E402
from arctic_rl.serve.config import ArcticRLClientConfig  # noqa: E402
from arctic_rl.serve.tinker.app import create_tinker_app  # noqa: E402
from arctic_rl.serve.tinker.service import TinkerService  # noqa: E402

TOKEN = "tml-test"


class StandInCore:
    """What ``TinkerService`` calls for sampling, recording each engine call; completions echo the prompt."""

    def __init__(self, model_dir, root) -> None:
        self.config = ArcticRLClientConfig.load({"model": str(model_dir), "server": {"root_dir": str(root)}})
        self.calls: list[dict] = []

    def eos_token_id(self) -> int:
        return 2

    def start(self) -> None:
        pass

    def sample(self, prompts, n=1, max_tokens=None, temperature=1.0, top_p=1.0, seed=None, prompt_seeds=None, stop_token_ids=()):
        self.calls.append({"prompts": prompts, "n": n, "seed": seed, "prompt_seeds": prompt_seeds})
        return SimpleNamespace(completions=[[Completion(p[-1:] * max_tokens, [-0.5] * max_tokens, "length")] * n for p in prompts])


@pytest.fixture
def served(tiny_model_dir, tmp_path):
    """The app on a loopback port in a thread (uvicorn), over a stand-in core."""
    from tests.helpers import app_on_loopback

    core = StandInCore(tiny_model_dir, tmp_path)
    with app_on_loopback(create_tinker_app(TinkerService(core), auth_token=TOKEN, max_request_bytes=1 << 20)) as url:
        yield url, core


def test_a_steps_concurrent_samples_reach_the_engine_in_one_call(served, tiny_model_dir):
    url, core = served
    prompts = [[1, 5 + i] for i in range(8)]
    with tinker.ServiceClient(base_url=url, api_key=TOKEN) as service:
        sampler = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=2,
                                  sampling_params=types.SamplingParams(max_tokens=3, seed=100 + i)) for i, p in enumerate(prompts)]
        results = [f.result() for f in futures]
    assert [[s.tokens for s in r.sequences] for r in results] == [[[p[-1]] * 3] * 2 for p in prompts]
    assert sum(len(call["prompts"]) for call in core.calls) == 8 and len(core.calls) <= 2, core.calls
    seeds = {tuple(p): s for call in core.calls for p, s in zip(call["prompts"], call["prompt_seeds"])}
    assert seeds == {tuple(p): mix_seed(100 + i, 0) for i, p in enumerate(prompts)}  # as a call of its own would seed it


def test_unknown_routes_and_wrong_keys_get_the_sdks_error_shape(served):
    url, _ = served
    reply = httpx.post(f"{url}/api/v1/publish_checkpoint", headers={"X-API-Key": TOKEN}, json={})
    assert reply.status_code == 404 and reply.json() == {
        "error": "UnknownOperation: POST /api/v1/publish_checkpoint is not part of arctic-rl's Tinker API (docs/tinker.md)",
        "category": "user"}
    reply = httpx.post(f"{url}/api/v1/create_session", headers={"X-API-Key": "tml-wrong"}, json={})
    assert reply.status_code == 401 and reply.json()["error"] == "AuthError: wrong API key"
    assert httpx.get(f"{url}/api/v1/healthz").json() == {"status": "ok"}


def test_api_tinker_serves_only_the_training_core(capsys):
    """``--api tinker`` over another handler than the default factory's is refused at start, in one line."""
    from arctic_rl.serve.server import main
    from tests.serve.fake_handler import FACTORY

    assert main(["--api", "tinker", "--handler", FACTORY, "--port", "0"]) == 2
    assert "--api tinker serves the training core of the default handler" in capsys.readouterr().err


def test_a_malformed_sample_is_refused_at_once_not_retried(served):
    """A 4xx the SDK does not retry (a 5xx it would, for minutes)."""
    url, core = served
    reply = httpx.post(f"{url}/api/v1/asample", headers={"X-API-Key": TOKEN},
                       json={"prompt": {"chunks": []}, "num_samples": "many", "sampling_params": {}})
    assert reply.status_code == 400 and "num_samples must be an integer >= 1" in reply.json()["error"]
    assert core.calls == []
