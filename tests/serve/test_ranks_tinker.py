"""``arctic-rl serve --api tinker`` on 2 training ranks (``training.devices: 2``, DeepSpeed ZeRO-2, gloo on CPU,
real rank processes) driven by the unmodified ``tinker`` SDK equals the same server on 1 rank (plain torch): a
3-step loop (seeded samples from the newest sampler weights, fixed advantages, ``forward_backward``
``importance_sampling``, ``optim_step`` with non-default ``AdamParams`` and clipping, ``save_weights_for_sampler``)
gives the same samples, ``loss:sum``, gradient norms and sampler weights, to float tolerance. Under ZeRO the
request's betas, eps and weight decay are set on the AdamW that DeepSpeed wraps; its ``grad_clip_norm`` must be
``optim.max_grad_norm`` (DeepSpeed clips inside its step), another value is refused, naming both."""

from __future__ import annotations

import secrets

import psutil
import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from arctic_rl.serve.server import start_server_process  # noqa: E402

pytestmark = pytest.mark.slow

G, STEPS, MAX_TOKENS, CLIP = 4, 3, 6, 1.0
PROMPTS = [[1, 5, 9, 11], [1, 6, 12]]
ADAM = dict(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.01, grad_clip_norm=CLIP)


def start(tiny_model_dir, root, devices: int):
    training = {"accelerator": "cpu", "devices": devices, "zero_stage": 2 if devices > 1 else 0}
    config = {"model": str(tiny_model_dir), "training": training, "optim": {"learning_rate": 1e-3, "max_grad_norm": CLIP},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 16},
              "server": {"root_dir": str(root)}}
    server = start_server_process(config, api="tinker", token=f"tml-{secrets.token_urlsafe(16)}", startup_timeout_s=600)
    server.root = root
    return server


def run_loop(service, server, model_dir) -> dict:
    """The Tinker user's loop through ``service`` (a ``ServiceClient`` of ``server``); what the tests compare,
    with the final sampler weights."""
    from transformers import AutoModelForCausalLM

    training = service.create_lora_training_client(base_model=str(model_dir), rank=0).result()
    path, steps = training.save_weights_for_sampler("step0").result().path, []
    for step in range(STEPS):
        sampler = service.create_sampling_client(model_path=path).result()
        params = types.SamplingParams(max_tokens=MAX_TOKENS, seed=step)
        sequences = [s for p in PROMPTS for s in sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=G,
                                                               sampling_params=params).result().sequences]
        advantages = torch.linspace(-1.0, 1.0, len(sequences)) * (1 if step % 2 else -1) + 0.25  # a loss away from 0
        datums = []
        for i, (s, a) in enumerate(zip(sequences, advantages.tolist())):
            prompt = PROMPTS[i // G]
            full, p = prompt + s.tokens, len(prompt) - 1
            datums.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": full[1:], "advantages": [0.0] * p + [a] * len(s.tokens), "logprobs": [0.0] * p + list(s.logprobs)}))
        fb = training.forward_backward(datums, "importance_sampling").result()
        stepped = training.optim_step(types.AdamParams(**ADAM)).result()
        path = training.save_weights_for_sampler(f"step{step + 1}").result().path
        steps.append({"tokens": [s.tokens for s in sequences], "loss": fb.metrics["loss:sum"],
                      "num_sequences": fb.metrics["num_sequences:sum"], "grad_norm": stepped.metrics["grad_norm"],
                      "logprobs": [o["logprobs"].tolist() for o in fb.loss_fn_outputs]})
    folder = server.root / "tinker" / path.split("//")[1].split("/")[0].replace(":", "_") / "sampler_weights" / path.rsplit("/", 1)[1]
    weights = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    return {"steps": steps, "weights": weights, "training": training, "datums": datums}


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory):
    server = start(tiny_model_dir, tmp_path_factory.mktemp("tinker-1"), 1)
    try:
        with tinker.ServiceClient(base_url=server.url, api_key=server.token) as service:  # closed: no heartbeat outlives the server
            return run_loop(service, server, tiny_model_dir)
    finally:
        server.stop()


@pytest.mark.timeout(900)
def test_tinker_on_two_ranks_equals_one_rank_and_refuses_another_clipping(one_rank, tiny_model_dir, tmp_path):
    server = start(tiny_model_dir, tmp_path, 2)
    try:
        with tinker.ServiceClient(base_url=server.url, api_key=server.token) as service:
            got = run_loop(service, server, tiny_model_dir)
            ranks = [p for p in psutil.Process(server.pid).children() if "ranks.worker" in " ".join(p.cmdline())]
            assert len(ranks) == 2  # the server's core started its 2 rank processes with the job
            with pytest.raises(tinker.RequestFailedError, match=r"max_grad_norm=0 differs from optim.max_grad_norm=1"):
                got["training"].optim_step(types.AdamParams(**{**ADAM, "grad_clip_norm": 0.0})).result()
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert not [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "a rank process outlived the server"
    for step, (g, w) in enumerate(zip(got["steps"], one_rank["steps"], strict=True)):
        assert g["tokens"] == w["tokens"], f"step {step}: different samples"
        assert g["num_sequences"] == w["num_sequences"] == len(PROMPTS) * G
        # loss:sum adds ~50 float32 terms of size <= 1.25: rounding alone is a few 1e-6
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-5), f"step {step} loss"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), f"step {step} grad norm"
        for a, b in zip(g["logprobs"], w["logprobs"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    # Adam (eps=1e-6) scales each element's step by 1/sqrt(v): where a gradient element is near eps, float32
    # reduction-order noise (gloo's sum of 2 shards vs one process) moves it by a small part of an lr step (3e-3):
    # every element within 1% of a step, all but 0.1% of them (23 of 78,400 seen) within 1e-6
    loose = 0
    for name, tensor in one_rank["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=3e-5, msg=lambda m: f"{name}: {m}")
        loose += int(((got["weights"][name] - tensor).abs() > 1e-6).sum())
    assert loose <= 1e-3 * sum(t.numel() for t in one_rank["weights"].values()), f"{loose} elements differ by > 1e-6"
