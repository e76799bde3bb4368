"""The core through the in-process client (a real Lightning run, a real vLLM engine): answers checked
against the model's own forward, bad requests refused with the job's state untouched, exact
save/load, path confinement, export."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from arctic_rl.serve.batch import TrainBatch
from arctic_rl.serve.client import ArcticRLClient
from arctic_rl.serve.errors import PathRefused, RequestError, UnknownOperation
from arctic_rl.serve.transport import Message
from tests.serve.conftest import client_config

pytestmark = pytest.mark.slow
PROMPTS = [[3, 14, 9, 15, 21], [3, 16, 8, 21]]  # token ids of the toy vocabulary
G = 4


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("server-root")
    config = client_config(tiny_model_dir, root, training={"reference_model": True}, compute={"micro_batch_size": 3})
    with ArcticRLClient(config) as c:
        c.root = root
        yield c


def sampled_batch(client: ArcticRLClient, seed: int = 0) -> TrainBatch:
    out = client.sample(PROMPTS, n=G, max_tokens=6, seed=seed)
    advantages = torch.linspace(-1.0, 1.0, len(PROMPTS) * G)
    return TrainBatch.build([p for p in PROMPTS for _ in range(G)], out.flat_token_ids(), advantages,
                            sampler_logprobs=out.flat_logprobs())


def own_forward_logprobs(model_dir, batch: TrainBatch) -> torch.Tensor:
    """The reference: the transformers model's own forward over each prompt + response, one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = torch.zeros_like(batch.response_mask)
    for i, prompt in enumerate(batch.prompt_token_ids):
        length = int(batch.response_mask[i].sum())
        ids = torch.tensor([prompt + batch.response_ids[i, :length].tolist()])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        out[i, :length] = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return out


def parameters_fingerprint(client: ArcticRLClient, batch: TrainBatch) -> torch.Tensor:
    return client.forward(batch, ["logprobs"])["logprobs"]


def test_sample_shapes_and_sampler_logprobs(client):
    out = client.sample(PROMPTS, n=G, max_tokens=6, seed=1)
    assert [len(per_prompt) for per_prompt in out.token_ids] == [G, G]
    for ids, lps, reason in zip(out.flat_token_ids(), out.flat_logprobs(), [r for per in out.finish_reason for r in per]):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) and all(lp <= 0 for lp in lps)
        assert reason in ("stop", "length") and (reason == "stop" or len(ids) == 6)
    again = client.sample(PROMPTS, n=G, max_tokens=6, seed=1)
    assert again.token_ids == out.token_ids  # seeded: reproducible


def test_forward_equals_the_models_own_forward(client, tiny_model_dir):
    batch = sampled_batch(client)
    out = client.forward(batch, ["logprobs", "entropy", "ref_logprobs"])
    want = own_forward_logprobs(tiny_model_dir, batch)  # no step taken yet: the initial weights
    mask = batch.response_mask.bool()
    torch.testing.assert_close(out["logprobs"][mask], want[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["ref_logprobs"][mask], want[mask], rtol=1e-5, atol=1e-5)
    assert (out["entropy"][mask] > 0).all() and (out["entropy"][mask] <= math.log(33) + 1e-4).all()
    # the sampler (vLLM) scored the same tokens with the same weights
    torch.testing.assert_close(batch.sampler_logprobs[mask], want[mask], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad, message", [
    (dict(loss="no_such_loss"), "unknown loss 'no_such_loss'"),
    (dict(loss_config={"clip_lo": 0.2}), "clip_lo"),
    (dict(advantages=torch.tensor([float("nan")] * 8)), "batch.advantages has a non-finite value"),
    (dict(advantages=torch.zeros(5)), "batch.advantages must be a float tensor of shape [8]"),
    (dict(response_ids=torch.full((8, 2), 999)), "batch.response_ids: a token id outside"),
    (dict(prompt=list(range(3, 33)) * 2), "over sampling.max_prompt_length=32"),
    (dict(loss_config={"kl_coef": -1.0}), "kl_coef"),
])
def test_bad_forward_backward_is_refused_and_changes_nothing(client, bad, message):
    batch = sampled_batch(client, seed=5)
    before, status = parameters_fingerprint(client, batch), client.status()
    if "advantages" in bad:
        batch.advantages = bad["advantages"]
    if "response_ids" in bad:
        batch.response_ids, batch.response_mask = bad["response_ids"], torch.ones(8, 2)
        batch.sampler_logprobs = None
    if "prompt" in bad:
        batch.prompt_token_ids = [bad["prompt"]] * 8
    with pytest.raises(RequestError) as refused:
        client.forward_backward(batch, bad.get("loss", "dapo"), bad.get("loss_config", {}))
    assert message in str(refused.value)
    after_step = client.optim_step()  # were any gradients left behind, this step would move the weights
    assert after_step["grad_norm"] == 0.0
    torch.testing.assert_close(parameters_fingerprint(client, sampled_batch(client, seed=5)), before, rtol=0, atol=0)
    assert client.status()["step"] == status["step"] + 1


def test_a_completion_ends_at_a_stop_token_the_client_names(client):
    greedy = client.sample(PROMPTS[:1], n=1, max_tokens=6, temperature=0.0).token_ids[0][0]
    stop = greedy[2]  # the third token: the completion ends at its first occurrence, kept
    cut = greedy[:greedy.index(stop) + 1]
    out = client.sample(PROMPTS[:1], n=1, max_tokens=6, temperature=0.0, stop_token_ids=[stop])
    assert out.token_ids == [[cut]]
    assert out.finish_reason == [["stop"]]


def test_unknown_operation_and_fields(client):
    with pytest.raises(UnknownOperation, match="known"):
        client._call("format_disk")
    with pytest.raises(RequestError, match="unknown fields"):
        client._call("optim_step", {"learning_rate": 1.0})
    with pytest.raises(RequestError, match="prompts"):
        client._call("sample", message=Message({"prompts": "not a list"}))


@pytest.mark.parametrize("path", ["../outside", "/etc/arctic", "a/../../b"])
def test_paths_outside_the_root_are_refused(client, path):
    for operation in (client.save_state, client.load_state, client.export):
        with pytest.raises(PathRefused):
            operation(path)


def train_step(client: ArcticRLClient, seed: int) -> tuple[dict, dict]:
    batch = sampled_batch(client, seed)
    out = client.forward_backward(batch, "dapo"), client.optim_step()
    client.sync_weights()
    return out


def test_save_and_load_state_resume_exactly(client):
    train_step(client, seed=11)
    saved = client.save_state("states/a")
    first = [train_step(client, seed=12 + i) for i in range(2)]
    probe = sampled_batch(client, seed=99)
    weights_after = parameters_fingerprint(client, probe)
    loaded = client.load_state("states/a")
    assert loaded["step"] == saved["step"]
    second = [train_step(client, seed=12 + i) for i in range(2)]  # same samples: load_state synced the engine
    for (fb1, st1), (fb2, st2) in zip(first, second):
        assert fb2["loss"] == fb1["loss"] and st2["grad_norm"] == st1["grad_norm"] and st2["lr"] == st1["lr"]
    torch.testing.assert_close(parameters_fingerprint(client, probe), weights_after, rtol=0, atol=0)


def test_kl_loss_uses_the_reference_model(client):
    train_step(client, seed=20)  # the policy moves away from the reference
    batch = sampled_batch(client, seed=21)
    out = client.forward(batch, ["logprobs", "ref_logprobs"])
    plain = client.forward_backward(batch, "dapo")
    client.zero_grad()
    with_kl = client.forward_backward(batch, "dapo", {"kl_coef": 0.1})
    client.zero_grad()
    # k3 = exp(ref - logp) - 1 - (ref - logp) per token (TRL's), token mean under dapo; on-policy the ratio is 1
    delta, mask = out["ref_logprobs"] - out["logprobs"], batch.response_mask
    kl = ((torch.exp(delta) - 1 - delta) * mask).sum() / mask.sum()
    assert kl > 0
    assert with_kl["loss"] == pytest.approx(plain["loss"] + 0.1 * kl.item(), rel=1e-4, abs=1e-7)


def test_mismatch_correction_uses_the_requests_sampler_logprobs(client):
    batch = sampled_batch(client, seed=30)
    out = client.forward_backward(batch, "dapo", {"vllm_importance_sampling_correction": True})
    client.zero_grad()
    # on-policy the old policy is the trainer's current one; the engine holds the same weights
    assert out["sampling/sampling_logp_difference/max"] < 1e-4
    assert out["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    unsent = dataclasses.replace(batch, sampler_logprobs=None)
    with pytest.raises(RequestError, match="need batch.sampler_logprobs"):
        client.forward_backward(unsent, "dapo", {"off_policy_mask_threshold": 0.5})


def test_export_is_served_by_vllm(client):
    from arctic_rl.rollout.engines.vllm.engine import VLLMEngine

    client.export("exported")
    batch = sampled_batch(client, seed=31)
    ours = parameters_fingerprint(client, batch)
    engine = VLLMEngine(str(client.root / "exported"), dtype="float32", max_model_len=64, seed=0)
    try:
        scored = engine.score([p + batch.response_ids[i, : int(batch.response_mask[i].sum())].tolist()
                               for i, p in enumerate(batch.prompt_token_ids)])
    finally:
        engine.shutdown()
    for i, p in enumerate(batch.prompt_token_ids):
        n = int(batch.response_mask[i].sum())
        torch.testing.assert_close(torch.tensor(scored[i][len(p) - 1:]), ours[i, :n], rtol=1e-3, atol=1e-3)


def multi_turn_batch() -> TrainBatch:
    """Two-turn responses: generated tokens, a tool's observation (loss mask 0), generated tokens again."""
    responses = [[5, 6, 7, 20, 21, 8, 9], [5, 6, 22, 23, 24, 10], [11, 12, 20, 13], [14, 15, 16]]
    masks = [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 1], [1, 1, 0, 1], [1, 1, 1]]
    prompts = [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2
    return TrainBatch.build(prompts, responses, torch.tensor([1.0, -1.0, 0.5, -0.5]), loss_masks=masks)


def test_multi_turn_batch_observations_are_inputs_not_targets(client):
    """A response with holes in its loss mask: the observation tokens are part of the sequence the model
    reads (each trained token's log-prob equals the same sequence's with every token scored, the path
    ``test_forward_equals_the_models_own_forward`` checks against the model's own forward), and get none."""
    batch = multi_turn_batch()
    out = client.forward(batch, ["logprobs"])["logprobs"]
    lengths = [7, 6, 4, 3]
    full = client.forward(TrainBatch.build(batch.prompt_token_ids, [batch.response_ids[i, :n].tolist() for i, n in enumerate(lengths)]),
                          ["logprobs"])["logprobs"]
    mask = batch.response_mask.bool()
    torch.testing.assert_close(out[mask], full[mask], rtol=1e-6, atol=1e-6)
    assert (out[~mask] == 0).all() and (full[~mask & (batch.response_ids != 0)] != 0).all()  # observations scored in full only
    assert math.isfinite(client.forward_backward(batch, "dapo")["loss"])  # the module's last test: no step follows


def test_optim_step_takes_this_steps_adam_settings(client):
    """``adam`` reaches the optimizer (a refused value names its field and leaves the step count alone)."""
    step = client.status()["step"]
    with pytest.raises(RequestError, match=r"adam must have exactly the fields"):
        client.optim_step(adam={"beta1": 0.9})
    with pytest.raises(RequestError, match=r"beta2=1.5 must be in \[0, 1\)"):
        client.optim_step(adam={"beta1": 0.9, "beta2": 1.5, "eps": 1e-8, "weight_decay": 0.0, "max_grad_norm": 0.0})
    assert client.status()["step"] == step
    out = client.optim_step(lr=1e-3, adam={"beta1": 0.8, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.0, "max_grad_norm": 0.0})
    assert out["step"] == step + 1 and out["lr"] == pytest.approx(1e-3)
