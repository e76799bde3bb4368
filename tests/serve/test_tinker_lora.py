"""``arctic-rl serve --api tinker`` with a LoRA config (``lora: {rank: 4, alpha: 8}``), driven by the unmodified
``tinker`` SDK: one server for the module (the tiny Qwen3, transformers engine, CPU).

``create_lora_training_client(rank=4)`` (the server's rank) trains; ``get_info`` reports LoRA and the rank. At the
first step the adapters are the identity (``lora_B`` = 0), so ``forward_backward``'s ``loss:sum`` is Tinker's
importance-sampling sum under the base model (1e-4); after ``optim_step`` the loss is that sum under the exported
(merged) sampler weights, which differ from the base by a rank <= 4 update on adapted layers only (embeddings and
norms bit for bit the base's). Another rank is refused with the SDK's error naming the server's rank.
"""

from __future__ import annotations

import secrets

import pytest
import torch

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from arctic_rl.serve.server import start_server_process  # noqa: E402

pytestmark = pytest.mark.slow
RANK = 4
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from arctic_rl.tasks.toy import write_tiny_model

    root = tmp_path_factory.mktemp("tinker-lora")
    model = write_tiny_model(root / "model", seed=0)
    config = {"model": str(model), "lora": {"rank": RANK, "alpha": 2.0 * RANK},
              "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 1e-3, "max_grad_norm": 1.0},
              "engines": {"engine": "transformers"}, "sampling": {"max_prompt_length": 32, "max_response_length": 16},
              "server": {"root_dir": str(root / "root")}}
    proc = start_server_process(config, api="tinker", token=f"tml-{secrets.token_urlsafe(16)}", startup_timeout_s=300)
    proc.model, proc.root = model, root / "root"
    yield proc
    proc.stop()


def load_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def importance_sampling(model, datums) -> float:
    """Tinker's definition: ``-sum(exp(logprobs - sampler logprobs) * advantages)`` over every target."""
    total = 0.0
    with torch.no_grad():
        for d in datums:
            ids, targets = torch.tensor([d.model_input.to_ints()]), torch.tensor(d.loss_fn_inputs["target_tokens"].tolist())
            logprobs = torch.log_softmax(model(ids).logits[0].double(), -1).gather(-1, targets[:, None])[:, 0]
            adv, sampler = (torch.tensor(d.loss_fn_inputs[k].tolist(), dtype=torch.float64) for k in ("advantages", "logprobs"))
            total -= float((torch.exp(logprobs - sampler) * adv).sum())
    return total


def datums(tokenizer) -> list[types.Datum]:
    rows = [("echo 7 :", " 7", 1.0), ("echo 7 :", " 3", -1.0), ("say 2 :", " 2", 0.5), ("say 2 :", " 9 9", -0.5)]
    out = []
    for prompt, answer, advantage in rows:
        p, a = tokenizer.encode(prompt), tokenizer.encode(answer)
        full = p + a
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
            "target_tokens": full[1:], "advantages": [0.0] * (len(p) - 1) + [advantage] * len(a),
            "logprobs": [0.0] * (len(full) - 1)}))
    return out


def test_lora_training_client_trains_rank_r_adapters_and_refuses_another_rank(lora_server):
    with tinker.ServiceClient(base_url=lora_server.url, api_key=lora_server.token) as service:  # closed before the server stops
        training = service.create_lora_training_client(base_model=str(lora_server.model), rank=RANK).result()
        info = training.get_info()
        assert (info.is_lora, info.lora_rank) == (True, RANK)
        batch = datums(training.get_tokenizer())
        base = load_model(lora_server.model)

        first = training.forward_backward(batch, "importance_sampling").result()
        assert first.metrics["loss:sum"] == pytest.approx(importance_sampling(base, batch), rel=1e-4, abs=1e-4)  # B = 0
        training.optim_step(ADAM).result()
        after = training.forward(batch, "importance_sampling").result().metrics["loss:sum"]
        path = training.save_weights_for_sampler("step1").result().path
        folder = lora_server.root / "tinker" / path.split("//")[1].split("/")[0].replace(":", "_") / "sampler_weights" / "step1"
        merged = load_model(folder)
        assert after == pytest.approx(importance_sampling(merged, batch), rel=1e-4, abs=1e-4)
        assert after < first.metrics["loss:sum"] - 1e-3  # the step lowered the loss it followed

        base_params, adapted = dict(base.named_parameters()), 0
        for name, value in merged.named_parameters():
            delta = (value - base_params[name]).detach()
            if name.endswith("proj.weight"):  # q/k/v/o and MLP projections: base + (alpha / r) B A, a rank <= r update
                adapted += 1
                assert 0 < torch.linalg.matrix_rank(delta.double(), atol=1e-6).item() <= RANK, name
            else:  # embeddings (the tied head) and norms: not adapted, the base's bit for bit
                assert torch.equal(value, base_params[name]), name
        assert adapted == 14  # 7 linear layers x 2 decoder layers

        with pytest.raises(tinker.RequestFailedError, match=rf"LoRA rank 8 is not what this server trains: LoRA adapters of rank {RANK}"):
            service.create_lora_training_client(base_model=str(lora_server.model), rank=8).result()
