"""Router replay (``arctic_rl/router_replay.py``, ``corrections.router_replay``) on CPU, float32, with tiny Qwen3-MoE and
Mixtral models whose routers are near-tied (their weights scaled down), so that a sampler whose router weights differ
by a tenth of their size picks other experts for about one token-layer in ten while its router probabilities, and so
the experts' weights, barely move.

The transformers engine samples with that copy and records its routing; the trainer's model is the unperturbed one.
Without replay the trainer routes those tokens elsewhere and its log-probs of the sampled tokens are off by percents;
with replay they equal the sampler's to 1e-6, under ZoRRo and naive, and checkpointing's recompute routes as its
forward did (the same gradients as no checkpointing)."""

from __future__ import annotations

import copy

import pytest
import torch

from arctic_rl.checkpointing import enable_checkpointing
from arctic_rl.errors import ConfigError
from arctic_rl.modules.models import response_logprobs
from arctic_rl.options import CorrectionConfig, ModuleOptions
from arctic_rl.options.sections import ComputeOptions
from arctic_rl.rollout.batch import RolloutBatch
from arctic_rl.rollout.engines.base import SamplingConfig
from arctic_rl.rollout.engines.factory import check_router_replay
from arctic_rl.rollout.engines.transformers.engine import TransformersEngine
from arctic_rl.rollout.generation import routing_of
from arctic_rl.router_replay import NOT_ROUTED, RoutedTokens, install_router_hooks, recording
from arctic_rl.zorro import zorro_response_logprobs

ROUTER_SCALE = 1e-5  # router weights scaled down: near-tied logits
SAMPLER_NOISE = 0.1  # the sampler's router weights differ by this share of their size
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              max_position_embeddings=128, attention_dropout=0.0, intermediate_size=48, num_experts_per_tok=2,
              tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": dict(model_type="qwen3_moe", moe_intermediate_size=16, num_experts=8, decoder_sparse_step=1, norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=8),
}
PROMPTS = ["echo 7 :", "the say x echo 6 : 1 2", "x 3"]
G = 3


def tiny_moe(kind: str, tokenizer) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**FAMILIES[kind], **COMMON, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.mul_(ROUTER_SCALE)
    return model.train()


def perturbed_routers(model: torch.nn.Module) -> torch.nn.Module:
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(SAMPLER_NOISE * p.abs().mean() * torch.randn(p.shape, generator=g))
    return other


class Rollout:
    """The engine's samples of ``PROMPTS`` (``G`` each) as a ``RolloutBatch`` with their routing, and the trainer's model."""

    def __init__(self, kind: str, tokenizer, root) -> None:
        self.trainer_model = tiny_moe(kind, tokenizer)
        self.sampler_model = perturbed_routers(self.trainer_model)
        self.sampler_model.save_pretrained(root)
        tokenizer.save_pretrained(root)
        engine = TransformersEngine(str(root))
        try:
            prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
            out = engine.generate(prompts, SamplingConfig(n=G, max_tokens=10, seed=3, return_routed_experts=True))
        finally:
            engine.shutdown()
        self.completions = [c for per_prompt in out for c in per_prompt]
        self.prompt_ids = [p for p in prompts for _ in range(G)]
        r = max(len(c.token_ids) for c in self.completions)
        self.response_ids = torch.full((len(self.completions), r), tokenizer.pad_token_id)
        self.mask = torch.zeros(len(self.completions), r)
        self.sampler_logprobs = torch.zeros(len(self.completions), r)
        for i, c in enumerate(self.completions):
            self.response_ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
            self.mask[i, : len(c.token_ids)] = 1.0
            self.sampler_logprobs[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
        self.routing = routing_of(self.prompt_ids, self.completions, r)
        self.pad_id = tokenizer.pad_token_id
        install_router_hooks(self.trainer_model)

    def logprobs(self, model, zorro: bool, routed: RoutedTokens | None) -> torch.Tensor:
        run = zorro_response_logprobs if zorro else response_logprobs
        return run(model, self.prompt_ids, self.response_ids, self.mask, 1.0, False, self.pad_id, routed=routed)[0]

    def gap(self, logprobs: torch.Tensor) -> float:
        return float(((logprobs.detach() - self.sampler_logprobs).abs() * self.mask).max())


@pytest.fixture(scope="module", params=list(FAMILIES))
def rollout(request, tokenizer, tmp_path_factory):
    return Rollout(request.param, tokenizer, tmp_path_factory.mktemp(request.param))


def test_the_engine_records_the_routing_of_every_token_it_fed(rollout):
    """Prompt tokens and generated tokens but the last: the sampler's own top-k, as a plain forward of its model over
    the whole sequence routes them; the last generated token (never fed back) is not routed."""
    install_router_hooks(rollout.sampler_model)
    for i, c in enumerate(rollout.completions):
        ids = torch.tensor([rollout.prompt_ids[i] + c.token_ids])
        seen = {}
        with torch.no_grad(), recording(lambda layer, top: seen.__setitem__(layer, top)):
            rollout.sampler_model(input_ids=ids)
        plain = torch.stack([seen[layer] for layer in sorted(seen)], 1)  # [T, M, k]
        recorded = c.routed_experts.long()
        assert recorded.shape == plain.shape
        assert (recorded[-1] == NOT_ROUTED).all()
        assert torch.equal(recorded[:-1].sort(-1).values, plain[:-1].sort(-1).values)


@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "naive"])
def test_replay_gives_the_sampler_logprobs_and_without_it_they_drift(rollout, zorro):
    with torch.no_grad():
        free = rollout.logprobs(rollout.trainer_model, zorro, None)
        routed = RoutedTokens(rollout.routing)
        replayed = rollout.logprobs(rollout.trainer_model, zorro, routed)
    metrics = routed.metrics()
    assert metrics["router/mismatch"] > 0.03 and metrics["router/mismatch_tokens"] >= metrics["router/mismatch"]
    assert rollout.gap(free) > 1e-2  # the flipped experts move the sampled tokens' log-probs
    assert rollout.gap(replayed) < 1e-6


@pytest.mark.parametrize("zorro", [True, False], ids=["zorro", "naive"])
def test_replay_under_checkpointing_gives_the_gradients_of_no_checkpointing(rollout, zorro):
    """The recompute in backward replays its forward's experts (else its graph would not be its forward's)."""
    weights = torch.randn(rollout.mask.shape, generator=torch.Generator().manual_seed(2))
    results = {}
    for mode in ("off", "full", "selective"):
        model = copy.deepcopy(rollout.trainer_model)
        enable_checkpointing(model, {"off": False, "full": "full", "selective": "selective"}[mode])
        install_router_hooks(model)
        lp = rollout.logprobs(model, zorro, RoutedTokens(rollout.routing))
        (weights * lp).sum().backward()
        results[mode] = (lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    lp, grads = results["off"]
    assert rollout.gap(lp) < 1e-6
    assert any(".mlp.gate." in n for n in grads)  # the router learns through the replayed experts' weights
    for mode in ("full", "selective"):
        assert torch.equal(results[mode][0], lp)
        assert grads.keys() == results[mode][1].keys()
        for name, grad in grads.items():
            torch.testing.assert_close(results[mode][1][name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")


def test_the_batch_carries_the_routing_through_take_and_concat(rollout):
    n, r = rollout.response_ids.shape
    batch = RolloutBatch(rollout.prompt_ids, rollout.response_ids, rollout.mask, rollout.sampler_logprobs, torch.zeros(n),
                         torch.zeros(n), G, routed_experts=rollout.routing)
    picked = batch.take([4, 0])
    assert torch.equal(picked.routed_experts, rollout.routing[[4, 0]])
    narrow = batch.select(slice(0, G))
    narrow = RolloutBatch.concat([narrow, batch.select(slice(G, 2 * G))])
    assert torch.equal(narrow.routed_experts, rollout.routing[: 2 * G])
    wide = replace_routing(batch.select(slice(0, G)), rollout.routing[:G, :5])
    joined = RolloutBatch.concat([wide, batch.select(slice(G, 2 * G))])
    assert joined.routed_experts.shape[1] == rollout.routing.shape[1]
    assert (joined.routed_experts[:G, 5:] == NOT_ROUTED).all()


def replace_routing(batch: RolloutBatch, routing: torch.Tensor) -> RolloutBatch:
    from dataclasses import replace

    return replace(batch, routed_experts=routing)


def test_bad_setups_are_refused_early(tokenizer):
    with pytest.raises(ConfigError, match="router_replay with RolloutCallback.engine 'vllm'.*Model Runner V2.*transformers"):
        check_router_replay("vllm")
    check_router_replay("transformers")
    with pytest.raises(ConfigError, match="zorro_dedup must be 'group'"):
        ModuleOptions(compute=ComputeOptions(zorro_dedup="tree"), corrections=CorrectionConfig(router_replay=True))
    from tests.zorro.models import build_tiny

    with pytest.raises(ConfigError, match="needs a mixture-of-experts model.*'qwen3' has none"):
        install_router_hooks(build_tiny("qwen3"))


@pytest.mark.parametrize("prompts_first", [False, True])
def test_packed_addresses_point_at_the_packed_tokens(prompts_first):
    """Every token of ZoRRo's packed row (equal prompts shared across groups too, padding, the cascade layout) comes
    from the naive layout's address it is given: the token ids there are the same."""
    import functools

    from arctic_rl.zorro.logprobs import packed_addresses
    from arctic_rl.zorro.packing import pack_shared_prompts

    prompts = [[5, 6, 7]] * 2 + [[8]] * 2 + [[5, 6, 7]] * 2  # the third group repeats the first's prompt
    lengths = [3, 1, 2, 0, 4, 2]
    responses = torch.zeros(6, 4, dtype=torch.long)
    for i, n in enumerate(lengths):
        responses[i, :n] = torch.arange(10 * (i + 1), 10 * (i + 1) + n)
    pack = functools.partial(pack_shared_prompts, lengths=lengths, pad_to_multiple=8, prompts_first=prompts_first)
    layout = pack(prompts, responses, pad_token_id=0)
    width = 3 + 4
    addresses = packed_addresses(pack, prompts, responses, width)
    naive = torch.zeros(6, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        naive[i, : len(p)] = torch.tensor(p)
        naive[i, len(p) : len(p) + 4] = responses[i]
    real = addresses >= 0
    assert torch.equal(naive.view(-1)[addresses[real]], layout.input_ids[real])
    assert int(real.sum()) == layout.processed_tokens  # only padding has no address
