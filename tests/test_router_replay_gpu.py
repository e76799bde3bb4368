"""GPU: router replay with a bf16 Qwen3-MoE on CUDA. The transformers engine (CUDA-graph decode) records each token's
experts: the same routing as its eager decode. The trainer's ZoRRo forward (FlexAttention) of the same weights in bf16
picks other experts for some tokens (the engine's kernels and batch shapes differ); replay routes them as the sampler
did, which shrinks the largest log-prob gap. The mismatch and both gaps are printed (``-s``)."""

import pytest
import torch

from arctic_rl.rollout.engines.base import SamplingConfig

pytestmark = pytest.mark.gpu

CONFIG = dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_experts=16,
              num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              vocab_size=4096, max_position_embeddings=1024, tie_word_embeddings=True, norm_topk_prob=True)


@pytest.fixture(scope="module")
def rollout(tmp_path_factory, tokenizer):
    from arctic_rl.modules.models import build_causal_lm
    from arctic_rl.rollout.engines.transformers.engine import TransformersEngine

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("gpu_qwen3_moe")
    model = build_causal_lm(dict(CONFIG), "bfloat16")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    engine = TransformersEngine(str(out), dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 4000, (int(torch.randint(10, 60, (1,), generator=g)),), generator=g).tolist() for _ in range(8)]
    sampling = SamplingConfig(n=4, max_tokens=64, seed=3, return_routed_experts=True)
    try:
        graphed = [c for o in engine.generate(prompts, sampling) for c in o]
        engine.decoder.cuda_graphs = False
        eager = [c for o in engine.generate(prompts, sampling) for c in o]
    finally:
        engine.shutdown()
    return model.to("cuda").train(), [p for p in prompts for _ in range(4)], graphed, eager


def test_cuda_graph_decode_records_the_eager_decode_routing(rollout):
    _, _, graphed, eager = rollout
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    for a, b in zip(graphed, eager):
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert (a.routed_experts[:-1] >= 0).all() and (a.routed_experts[-1] == -1).all()


def test_replay_removes_the_routing_part_of_the_bf16_gap(rollout):
    from arctic_rl.rollout.generation import routing_of
    from arctic_rl.router_replay import RoutedTokens, install_router_hooks
    from arctic_rl.zorro import zorro_response_logprobs

    model, prompt_ids, flat, _ = rollout
    install_router_hooks(model)
    r = max(len(c.token_ids) for c in flat)
    ids = torch.zeros(len(flat), r, dtype=torch.long)
    mask, sampler = torch.zeros(len(flat), r), torch.zeros(len(flat), r)
    for i, c in enumerate(flat):
        ids[i, : len(c.token_ids)] = torch.tensor(c.token_ids)
        mask[i, : len(c.token_ids)] = 1.0
        sampler[i, : len(c.token_ids)] = torch.tensor(c.logprobs)
    ids, mask, sampler = ids.cuda(), mask.cuda(), sampler.cuda()
    routed = RoutedTokens(routing_of(prompt_ids, flat, r).cuda())
    with torch.no_grad():
        free = zorro_response_logprobs(model, prompt_ids, ids, mask, 1.0, False, 0)[0]
        replayed = zorro_response_logprobs(model, prompt_ids, ids, mask, 1.0, False, 0, routed=routed)[0]
    gap_free, gap_replayed = ((free - sampler).abs() * mask), ((replayed - sampler).abs() * mask)
    metrics = routed.metrics()
    print(f"bf16 MoE on CUDA: {int(mask.sum())} tokens, mismatch {metrics['router/mismatch']:.4f} (token-layer) / "
          f"{metrics['router/mismatch_tokens']:.4f} (token); gap mean {float(gap_free.sum() / mask.sum()):.3e} without,"
          f" {float(gap_replayed.sum() / mask.sum()):.3e} with; max {float(gap_free.max()):.3e} without, "
          f"{float(gap_replayed.max()):.3e} with")
    assert 0.0 < metrics["router/mismatch"] < 0.5  # bf16 flips some near ties, not most
    assert float(gap_replayed.max()) <= float(gap_free.max())
    assert float(gap_replayed.sum()) < float(gap_free.sum())
