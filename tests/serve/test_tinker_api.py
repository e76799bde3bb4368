"""``arctic-rl serve --api tinker`` driven by the unmodified ``tinker`` SDK (0.38): a real server on loopback
(one per module, the quickstart's tiny Qwen3, transformers engine, CPU) runs three GRPO steps: sample G
completions per prompt from the newest sampler weights, rewards and group advantages here,
``forward_backward(importance_sampling)``, ``optim_step(AdamParams)``, ``save_weights_for_sampler``.

Checked against references computed here from the exported sampler weights (``save_pretrained`` folders under
``server.root_dir``): ``forward_backward``'s per-target log-probs equal the model's own forward (1e-5); each
step's ``loss:sum`` is Tinker's importance-sampling sum at that step's weights; the first two optimizer steps
are torch's AdamW with the request's betas/eps/decay and no clipping (Tinker's ``grad_clip_norm=0``); the
weights change every step; and what arctic-rl cannot do is refused with the SDK's error, naming it.
"""

from __future__ import annotations

import json
import secrets

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from arctic_rl.serve.server import start_server_process  # noqa: E402

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
NUM_PROMPTS = 2
STEPS = 3
MAX_TOKENS = 6
ADAM = dict(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.01)  # not torch's defaults


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Tinker API server on loopback (its token starts with ``tml-``, as the SDK requires); stopped after the module."""
    from arctic_rl.tasks.toy import write_task, write_tiny_model

    root = tmp_path_factory.mktemp("tinker-api")
    model = write_tiny_model(root / "model", seed=0)
    task = write_task(root / "task", num_train=NUM_PROMPTS, num_val=1)
    config = {"model": str(model),
              "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 1e-3, "max_grad_norm": 1.0},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 48},
              "server": {"root_dir": str(root / "root")}}
    proc = start_server_process(config, api="tinker", token=f"tml-{secrets.token_urlsafe(16)}", startup_timeout_s=300)
    proc.model, proc.root = model, root / "root"
    proc.rows = [json.loads(line) for line in (task / "train.jsonl").read_text().splitlines()]
    yield proc
    proc.stop()


def load_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def target_logprobs(model, d: types.Datum) -> torch.Tensor:
    """The reference: ``log_softmax(model(ids).logits)`` at each target (with grad when enabled)."""
    ids = torch.tensor([d.model_input.to_ints()])
    targets = torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
    return torch.log_softmax(model(ids).logits[0].double(), -1).gather(-1, targets[:, None])[:, 0]


def importance_sampling(model, datums) -> torch.Tensor:
    """Tinker's definition: ``-sum(exp(logprobs - sampler logprobs) * advantages)`` over every target."""
    total = torch.zeros((), dtype=torch.float64)
    for d in datums:
        adv, sampler = (torch.tensor(d.loss_fn_inputs[k].tolist(), dtype=torch.float64) for k in ("advantages", "logprobs"))
        total = total - (torch.exp(target_logprobs(model, d) - sampler) * adv).sum()
    return total


def rl_datum(prompt, sequence, advantage) -> types.Datum:
    """The cookbook's layout: the sequence shifted by one, advantage and sampler log-prob 0 on the prompt's targets."""
    full, p = prompt + sequence.tokens, len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
        "target_tokens": full[1:], "advantages": [0.0] * p + [advantage] * len(sequence.tokens),
        "logprobs": [0.0] * p + list(sequence.logprobs)})


def with_hole_and_tail(d: types.Datum) -> types.Datum:
    """A copy of ``d`` whose second trained target and last target add nothing (advantage 0): a hole inside the
    trained span and a target after it, so ``forward_backward`` answers this datum's log-probs by another forward."""
    inputs = {k: v.tolist() for k, v in d.loss_fn_inputs.items()}
    first = len(inputs["advantages"]) - 4
    inputs["advantages"][first + 1] = inputs["advantages"][-1] = 0.0
    inputs["advantages"][first] = inputs["advantages"][first + 2] = 1.0
    return types.Datum(model_input=d.model_input, loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def grpo(server):
    """The loop, as a Tinker user writes it, with what the tests compare."""
    from arctic_rl.tasks.toy import echo_score

    service = tinker.ServiceClient(base_url=server.url, api_key=server.token)
    training = service.create_lora_training_client(base_model=str(server.model), rank=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(row["prompt"]) for row in server.rows]
    run = {"service": service, "training": training, "steps": [], "paths": []}
    path = training.save_weights_for_sampler("step0").result().path
    for step in range(STEPS):
        run["paths"].append(path)
        sampler = service.create_sampling_client(model_path=path).result()
        futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=GROUP_SIZE,
                                  sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS, seed=step,
                                                                       stop=[tokenizer.eos_token_id])) for p in prompts]
        datums, rewards = [], []
        for prompt, row, future in zip(prompts, server.rows, futures):
            sequences = future.result().sequences
            r = torch.tensor([echo_score(tokenizer.decode(s.tokens), row["answer"]) + 0.01 * len(set(s.tokens)) for s in sequences])
            advantages = (r - r.mean()) / (r.std() + 1e-6)
            datums += [rl_datum(prompt, s, float(a)) for s, a in zip(sequences, advantages)]
            rewards.append(r)
        datums.append(with_hole_and_tail(max(datums, key=lambda d: len(d.loss_fn_inputs["target_tokens"].tolist()))))
        record = {"datums": datums, "reward": float(torch.cat(rewards).mean()), "sequences": futures}
        record["forward_backward"] = training.forward_backward(datums, "importance_sampling").result()
        record["optim_step"] = training.optim_step(types.AdamParams(**ADAM)).result()
        path = training.save_weights_for_sampler(f"step{step + 1}").result().path
        run["steps"].append(record)
    run["paths"].append(path)
    folder = lambda p: server.root / "tinker" / p.split("//")[1].split("/")[0].replace(":", "_") / "sampler_weights" / p.rsplit("/", 1)[1]  # noqa: E731
    run["models"] = [load_model(folder(p)) for p in run["paths"]]
    yield run
    service.close("success").result()  # its session's heartbeat stops before the server does


def test_forward_backward_logprobs_are_the_models_own(grpo):
    for record, model in zip(grpo["steps"], grpo["models"]):
        for d, out in zip(record["datums"], record["forward_backward"].loss_fn_outputs):
            with torch.no_grad():
                want = target_logprobs(model, d).float()
            torch.testing.assert_close(torch.tensor(out["logprobs"].tolist()), want, atol=1e-5, rtol=0)


def test_loss_is_tinkers_importance_sampling_sum(grpo):
    for record, model in zip(grpo["steps"], grpo["models"]):
        with torch.no_grad():
            want = float(importance_sampling(model, record["datums"]))
        metrics = record["forward_backward"].metrics
        assert metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)
        assert metrics["num_sequences:sum"] == NUM_PROMPTS * GROUP_SIZE + 1  # with_hole_and_tail's datum


def test_optimizer_steps_are_adamw_with_the_requests_settings(grpo):
    """Two steps of torch's AdamW (betas, eps, weight decay from AdamParams; no clipping) on the reference
    gradients reproduce the server's weights after each step."""
    model = load_model(grpo["models"][0].name_or_path)
    params = [p for p in model.parameters()]
    optimizer = torch.optim.AdamW(params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                                  weight_decay=ADAM["weight_decay"])
    for step in range(2):
        optimizer.zero_grad()
        importance_sampling(model, grpo["steps"][step]["datums"]).backward()
        optimizer.step()
        served = dict(grpo["models"][step + 1].named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), served[name].detach(), atol=5e-5, rtol=1e-4, msg=f"step {step + 1}: {name}")


def test_optim_step_metrics_and_weights_change_every_step(grpo):
    for i, record in enumerate(grpo["steps"]):
        metrics = record["optim_step"].metrics
        assert metrics["lr"] == pytest.approx(ADAM["learning_rate"]) and metrics["step"] == i + 1 and metrics["grad_norm"] > 0
    states = [dict(m.named_parameters()) for m in grpo["models"]]
    for before, after in zip(states, states[1:]):
        changed = [name for name in before if not torch.equal(before[name], after[name])]
        assert len(changed) > len(before) // 2


def test_samples_come_from_the_newest_sampler_weights(grpo):
    """Each sampled token's log-prob is the sampler weights' own (the engine holds exactly those weights)."""
    for record, model in zip(grpo["steps"], grpo["models"]):
        d = record["datums"][0]
        n = len(record["sequences"][0].result().sequences[0].tokens)
        with torch.no_grad():
            want = target_logprobs(model, d)[-n:].float()
        got = torch.tensor(d.loss_fn_inputs["logprobs"].tolist()[-n:])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_concurrent_samples_equal_one_at_a_time(grpo, server):
    """Concurrent requests with the same settings run as one engine call, each prompt with its own request's
    seed: the same tokens as sending them one after another."""
    sampler = grpo["service"].create_sampling_client(model_path=grpo["paths"][-1]).result()
    prompts = [[1, 5, 6, 7], [1, 8, 9], [1, 10, 11, 12, 13]]
    params = [types.SamplingParams(max_tokens=MAX_TOKENS, seed=11 + i) for i in range(len(prompts))]

    def tokens(responses):
        return [[s.tokens for s in r.sequences] for r in responses]

    alone = tokens([sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=3, sampling_params=q).result()
                    for p, q in zip(prompts, params)])
    futures = [sampler.sample(prompt=types.ModelInput.from_ints(p), num_samples=3, sampling_params=q) for p, q in zip(prompts, params)]
    assert tokens([f.result() for f in futures]) == alone


CONFIGS = {"ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "cispo": {}, "dro": {"beta": 0.05}}


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_forward_reports_each_losss_definition(grpo, loss_fn):
    """``forward`` (no backward) at the final weights: ``loss:sum`` is the SDK's definition of each loss, over
    every target, with per-token advantages that vary (a KL-style penalty added to the last datum's)."""
    datums = grpo["steps"][-1]["datums"][:3]
    last = datums[-1]
    advantages = [a - 0.01 * j for j, a in enumerate(last.loss_fn_inputs["advantages"].tolist())]
    datums[-1] = types.Datum(model_input=last.model_input, loss_fn_inputs={**last.loss_fn_inputs, "advantages": advantages})
    if loss_fn == "cross_entropy":
        datums = [types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": [float(a != 0) for a in d.loss_fn_inputs["advantages"].tolist()]})
            for d in datums]
    config = CONFIGS.get(loss_fn, {})
    out = grpo["training"].forward(datums, loss_fn, loss_fn_config=config or None).result()
    model, want = grpo["models"][-1], 0.0
    with torch.no_grad():
        for d in datums:
            lp = target_logprobs(model, d)
            if loss_fn == "cross_entropy":
                want -= float((torch.tensor(d.loss_fn_inputs["weights"].tolist(), dtype=torch.float64) * lp).sum())
                continue
            adv, q = (torch.tensor(d.loss_fn_inputs[k].tolist(), dtype=torch.float64) for k in ("advantages", "logprobs"))
            r = torch.exp(lp - q)
            lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
            per_token = {"importance_sampling": r * adv, "ppo": torch.minimum(r * adv, r.clamp(lo, hi) * adv),
                         "cispo": r.clamp(lo, hi) * lp * adv,
                         "dro": lp * adv - 0.5 * config.get("beta", 0.0) * (lp - q) ** 2}[loss_fn]
            want -= float(per_token.sum())
    assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4)


def test_refusals_name_what_is_unsupported(grpo, server):
    service, training = grpo["service"], grpo["training"]
    d = grpo["steps"][0]["datums"][0]
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'gspo' is not supported by arctic-rl"):
        training.forward_backward([d], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_config beta"):
        training.forward_backward([d], "dro").result()
    old = service.create_sampling_client(model_path=grpo["paths"][0]).result()
    with pytest.raises(tinker.RequestFailedError, match="only the newest weights saved for the sampler can be sampled"):
        old.sample(prompt=types.ModelInput.from_ints([1, 2]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    newest = service.create_sampling_client(model_path=grpo["paths"][-1]).result()
    with pytest.raises(tinker.RequestFailedError, match=r"sampling_params.stop=\['\\n'\] is not supported"):
        newest.sample(prompt=types.ModelInput.from_ints([1, 2]), num_samples=1,
                      sampling_params=types.SamplingParams(max_tokens=2, stop=["\n"])).result()
    with pytest.raises(tinker.RequestFailedError, match=r"LoRA rank 8 is not what this server trains: all weights \(no LoRA\)"):
        service.create_lora_training_client(base_model=str(server.model), rank=8).result()
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=server.url, api_key="tml-wrong").create_lora_training_client(base_model=str(server.model), rank=0).result()


def test_save_state_and_load_state_with_optimizer_restore_the_weights(grpo):
    """Last in the module (it leaves the engines holding a loaded state): save, train a step, load; the
    log-probs are the saved weights' again, exactly."""
    training, datums = grpo["training"], grpo["steps"][-1]["datums"][:2]

    def logprobs():
        return [o["logprobs"].tolist() for o in training.forward(datums, "importance_sampling").result().loss_fn_outputs]

    saved, before = training.save_state("resume").result().path, logprobs()
    assert saved.endswith("/weights/resume")
    training.forward_backward(datums, "importance_sampling").result()
    training.optim_step(types.AdamParams(**ADAM)).result()
    assert logprobs() != before
    training.load_state_with_optimizer(saved).result()
    assert logprobs() == before
    with pytest.raises(tinker.RequestFailedError, match="load_weights without the optimizer is not supported"):
        training.load_state(saved).result()
