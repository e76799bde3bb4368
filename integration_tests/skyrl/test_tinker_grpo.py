"""Two GRPO steps driven by the real ``tinker`` SDK against SkyRL's own Tinker API server and engine
(started on loopback with backend ``arctic``): sample G completions per prompt, rewards and group
advantages here, ``forward_backward(importance_sampling)``, ``optim_step``, new sampler weights.

What is checked against references computed here: ``forward``'s log-probs equal the model's own forward
(1e-5); each step's ``loss:sum`` equals Tinker's importance-sampling loss computed from the model at that
step's weights; the sampler checkpoints' weights change step by step; refusals name what is unsupported
(a second model; a LoRA rank other than the backend config's ``lora.rank``); a plugin loss routed by the backend
config's ``loss_fns`` trains.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

GROUP_SIZE = 4
MAX_TOKENS = 8  # sampled per completion
NUM_PROMPTS = 2
LEARNING_RATE = 3e-3


def reward(tokens: list[int], text: str, answer: str) -> float:
    """The toy task's echo score plus a diversity tie-breaker, so a random model's groups never tie (a group
    with equal rewards has zero advantages and would train nothing)."""
    from arctic_rl.tasks.toy import echo_score

    return echo_score(text, answer) + 0.01 * len(set(tokens))


def datum(prompt: list[int], completion: list[int], sampler_logprobs: list[float], advantage: float) -> types.Datum:
    """The Tinker cookbook's RL datum: next-token layout, zero advantage and weight on the prompt's targets."""
    full, p = prompt + completion, len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "weights": [0.0] * p + [1.0] * len(completion),
        "advantages": [0.0] * p + [advantage] * len(completion), "logprobs": [0.0] * p + list(sampler_logprobs)})


def model_logprobs(model, d: types.Datum) -> torch.Tensor:
    """The reference: ``log_softmax(model(ids).logits)`` at each target."""
    ids = torch.tensor([d.model_input.to_ints()])
    targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def tinker_importance_sampling(model, datums: list[types.Datum]) -> float:
    """Tinker's definition: sum over targets of -weight * exp(logprob - sampler logprob) * advantage."""
    total = 0.0
    for d in datums:
        inp = {k: torch.tensor(v.tolist(), dtype=torch.float64) for k, v in d.loss_fn_inputs.items() if k != "target_tokens"}
        ratio = torch.exp(model_logprobs(model, d).double() - inp["logprobs"])
        total += float(-(inp["weights"] * ratio * inp["advantages"]).sum())
    return total


def load_sampler_weights(archive: Path, into: Path):
    """The ``save_pretrained`` model inside a sampler checkpoint's tarball."""
    from transformers import AutoModelForCausalLM

    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    (folder,) = into.iterdir()
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def grpo_run(skyrl_server, tiny_model_dir, tmp_path_factory):
    """The two steps, with everything the tests compare."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [json.loads(line) for line in (tiny_model_dir / "prompts.jsonl").read_text().splitlines()[:NUM_PROMPTS]]
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    service = tinker.ServiceClient(base_url=skyrl_server.url, api_key="tml-local")
    training = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=0)
    models = [AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()]
    run = {"training": training, "service": service, "steps": [], "checkpoints": [], "models": models}
    sampler = training.create_sampling_client(training.save_weights_for_sampler("step0").result().path)
    for step in range(2):
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=GROUP_SIZE,
                                  sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=step))
                   for p in prompts]
        datums = []
        for prompt, row, future in zip(prompts, rows, futures):
            sequences = future.result().sequences
            rewards = torch.tensor([reward(s.tokens, tokenizer.decode(s.tokens), row["answer"]) for s in sequences])
            advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            datums += [datum(prompt, s.tokens, s.logprobs, float(a)) for s, a in zip(sequences, advantages)]
        record = {"datums": datums}
        if step == 0:
            record["forward"] = training.forward(datums, "importance_sampling").result()
        record["forward_backward"] = training.forward_backward(datums, "importance_sampling").result()
        record["optim_step"] = training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
        saved = training.save_weights_for_sampler(f"step{step + 1}").result()
        sampler = training.create_sampling_client(saved.path)
        archive = next(skyrl_server.checkpoints.glob(f"*/sampler_weights/step{step + 1}.tar.gz"))
        models.append(load_sampler_weights(archive, tmp_path_factory.mktemp(f"step{step + 1}")))
        run["steps"].append(record)
    return run


def test_forward_logprobs_equal_the_models_own_forward(grpo_run):
    step = grpo_run["steps"][0]
    model = grpo_run["models"][0]
    for d, out in zip(step["datums"], step["forward"].loss_fn_outputs):
        got = torch.tensor(out["logprobs"].tolist())
        want = model_logprobs(model, d)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("step", [0, 1])
def test_loss_is_tinkers_importance_sampling(grpo_run, step):
    record = grpo_run["steps"][step]
    want = tinker_importance_sampling(grpo_run["models"][step], record["datums"])
    got = record["forward_backward"].metrics["loss:sum"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    tokens = sum(len(d.loss_fn_inputs["target_tokens"].tolist()) - d.loss_fn_inputs["weights"].tolist().count(0.0)
                 for d in record["datums"])
    assert record["forward_backward"].metrics["num_tokens:sum"] == tokens


def test_advantages_were_not_all_zero(grpo_run):
    for record in grpo_run["steps"]:
        assert any(max(abs(a) for a in d.loss_fn_inputs["advantages"].tolist()) > 0.1 for d in record["datums"])


def test_optim_step_reports_the_requested_rate(grpo_run):
    for i, record in enumerate(grpo_run["steps"]):
        metrics = record["optim_step"].metrics
        assert metrics["lr"] == pytest.approx(LEARNING_RATE)
        assert metrics["step"] == i + 1
        assert metrics["grad_norm"] > 0


def test_sampler_weights_change_every_step(grpo_run):
    states = [dict(model.named_parameters()) for model in grpo_run["models"]]
    for before, after in zip(states, states[1:]):
        changed = [name for name in before if not torch.equal(before[name], after[name])]
        assert len(changed) > len(before) // 2, f"only {changed} changed"


def test_a_second_model_is_refused_naming_the_one_held(grpo_run, tiny_model_dir):
    with pytest.raises(Exception, match="backend arctic holds one model"):
        grpo_run["service"].create_lora_training_client(base_model=str(tiny_model_dir), rank=8)


def test_a_lora_rank_other_than_the_configured_one_is_refused(tiny_model_dir):
    from arctic_rl.integrations.skyrl.backend import ArcticBackend, ArcticBackendConfig
    from skyrl.tinker.types import LoraConfig

    backend = ArcticBackend(str(tiny_model_dir), ArcticBackendConfig(lora={"rank": 4}))
    with pytest.raises(ValueError, match=r"trains LoRA adapters of rank 4 \(its lora.rank\): create the training client "
                                         r"with rank=4 \(got rank=8\)"):
        backend.create_model("m", LoraConfig(rank=8, alpha=8.0, seed=0))
    assert backend.client is None and backend.model_id is None  # refused before any job started


def test_per_token_advantages_are_trained_exactly(grpo_run):
    """Advantages that vary over a response (arctic_rl/serve/tinker/batch.py sends them per token): the loss is
    still Tinker's importance-sampling sum, at the weights after the last step (the newest sampler checkpoint).
    Its gradients stay accumulated: no test steps the optimizer after this one.
    Not run when this changed (the SkyRL stage was not run on that machine)."""
    d = grpo_run["steps"][1]["datums"][0]
    adv = d.loss_fn_inputs["advantages"].tolist()
    adv[-1] += 1.0
    varied = types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "advantages": adv})
    got = grpo_run["training"].forward_backward([varied], "importance_sampling").result().metrics["loss:sum"]
    assert got == pytest.approx(tinker_importance_sampling(grpo_run["models"][-1], [varied]), rel=1e-5, abs=1e-5)


def test_a_routed_plugin_loss_trains(grpo_run, skyrl_server):
    """The backend config routes ``cispo`` to the installed plugin's ``scaled_pg`` at scale 2: the SDK's ``cispo``
    request runs the plugin in SkyRL's engine process. On-policy (no old log-probs sent) its ratio is 1, so its loss
    is ``-2 * sum(A) / tokens`` over the weighted targets, and its stat comes back as ``plugin/ratio_mean:mean``."""
    datums = grpo_run["steps"][1]["datums"]
    metrics = grpo_run["training"].forward_backward(datums, "cispo").result().metrics
    weighted = [(a, w) for d in datums for a, w in zip(d.loss_fn_inputs["advantages"].tolist(),
                                                        d.loss_fn_inputs["weights"].tolist()) if w]
    assert metrics["num_tokens:sum"] == len(weighted)
    assert metrics["loss:sum"] == pytest.approx(-2.0 * sum(a for a, _ in weighted) / len(weighted), rel=1e-5, abs=1e-6)
    assert metrics["plugin/ratio_mean:mean"] == 1.0
    calls = skyrl_server.plugin_marker.read_text().splitlines()
    assert calls and set(calls) == {"True"}  # every micro-batch, with the entropy it needs


def test_backend_refuses_a_remote_core():
    from arctic_rl.integrations.skyrl.backend import ArcticBackend, ArcticBackendConfig

    with pytest.raises(ValueError, match="protocol must be 'local'"):
        ArcticBackend("m", ArcticBackendConfig(protocol="http"))
