"""A GRPO loop written against ``ArcticRLClient`` (sample -> reward -> advantages -> forward_backward ->
optim_step -> sync_weights) reproduces ``arctic-rl fit`` on the quickstart task: the same completions,
losses, gradient norms and, after 3 steps, the same parameters. Real parts: the CLI in a subprocess, vLLM
engines on both sides, and the client over each protocol."""

from __future__ import annotations

import json

import pytest
import torch

from arctic_rl.modules.advantages import group_advantages
from arctic_rl.rollout.engines.seeds import prompt_seeds
from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.tasks.toy import echo_score
from tests.helpers import quickstart_config, run_cli
from tests.serve.conftest import client_config

STEPS, G = 3, 8
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory, toy_task, tiny_model_dir):
    """``arctic-rl fit`` for 3 steps from ``tiny_model_dir``, recorded step by step."""
    root = tmp_path_factory.mktemp("fit")
    record, weights = root / "steps.jsonl", root / "weights.pt"
    config = quickstart_config(toy_task, root, **{"model.init_args.model": str(tiny_model_dir), "trainer.max_steps": STEPS})
    config["trainer"]["callbacks"].append(
        {"class_path": "tests.serve.fit_recorder.RecordTraining", "init_args": {"path": str(record), "weights_path": str(weights)}})
    done = run_cli(config, root / "config.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(STEPS))
    return steps, torch.load(weights)


def client_loop(client: ArcticRLClient, steps: list[dict], root) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The quickstart's GRPO step, written against the client; the prompts and answers are the fit run's."""
    seen = []
    for step, recorded in enumerate(steps):
        prompts = recorded["prompt_ids"]
        out = client.sample(prompts, n=G, max_tokens=8, temperature=1.0, prompt_seeds=list(prompt_seeds(0, step, len(prompts))))
        answers = [a for a in recorded["answer"] for _ in range(G)]
        completions = [text for per_prompt in out.text for text in per_prompt]
        rewards = torch.tensor([echo_score(c, a) for c, a in zip(completions, answers)])
        batch = TrainBatch.build([p for p in prompts for _ in range(G)], out.flat_token_ids(),
                                 group_advantages(rewards, G, "grpo", "group"), sampler_logprobs=out.flat_logprobs())
        before = client.forward(batch, ["logprobs"])["logprobs"]
        metrics = client.forward_backward(batch, "dapo", {"clip_low": 0.2, "clip_high": 0.2}, processors=["logprobs"])
        # the log-probs that took the gradient are the policy's (the loss's own forward, returned without a second pass)
        torch.testing.assert_close(metrics["outputs"]["logprobs"], before, atol=1e-6, rtol=0)
        stepped = client.optim_step()
        client.sync_weights()
        seen.append({"completions": completions, "loss": metrics["loss"], "grad_norm": stepped["grad_norm"]})
    client.export("final")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "final", dtype=torch.float32)
    return seen, model.state_dict()


def assert_same_run(fit_run, seen, weights) -> None:
    steps, fit_weights = fit_run
    for step, (want, got) in enumerate(zip(steps, seen)):
        assert got["completions"] == want["completions"], f"step {step}: different samples"
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), f"step {step} loss"
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), f"step {step} grad norm"
    for name, tensor in fit_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("protocol", ["local", "http", "ray"])
def test_client_loop_reproduces_fit(protocol, fit_run, tiny_model_dir, tmp_path):
    config = client_config(tiny_model_dir, tmp_path, protocol=protocol)
    with ArcticRLClient(config) as client:
        seen, weights = client_loop(client, fit_run[0], tmp_path)
    assert_same_run(fit_run, seen, weights)
