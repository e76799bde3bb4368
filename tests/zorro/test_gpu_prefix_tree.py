"""GPU: prefix-tree ZoRRo (``dedup="tree"``) on compiled FlexAttention, against each sequence run alone
through the model's own forward: fp32 closely (relative error < 1e-3 on log-probs, entropies and every
gradient, as ``test_gpu.py``'s flex fp32 check), bf16 within 2x the naive bf16 path's own error (plus a
small floor), and flex against the dense ``sdpa`` tree mask. Lengths straddle the 128-token blocks and
the tree has depth 4, holes, a truncated branch and a duplicate."""

import pytest
import torch

from arctic_rl.modules.models import response_logprobs
from arctic_rl.zorro import zorro_response_logprobs

from .models import CONFIGS, build_tiny, twin
from .test_gpu import GPU_SIZES, rel_errors, run
from .test_prefix_tree import batch_of, rand

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def gpu_sized_configs(monkeypatch):
    for kind in CONFIGS:
        monkeypatch.setitem(CONFIGS, kind, {**CONFIGS[kind], **GPU_SIZES})


def tree_batch():
    g = torch.Generator().manual_seed(7)
    system, user1, user2 = rand(g, 150), rand(g, 40), rand(g, 90)
    turn, obs, obs2 = rand(g, 100), rand(g, 30), rand(g, 20)
    branches = [[10 + k] + rand(g, 60 + 50 * k) for k in range(3)]
    samples = [(system + user1, [(turn, True), (obs, False), (b, True)]) for b in branches]
    samples += [(system + user1, [(turn, True), (obs, False), (branches[0], True), (obs2, False), ([20 + k] + rand(g, 70), True)])
                for k in range(2)]
    samples += [(system + user2, [(rand(g, 129), True)]), (system + user2, [(turn[:57], True)]), samples[0]]
    samples += [(system + user1, [(turn[:31], True)])]  # budget-truncated inside the shared turn
    prompts, ids, mask = batch_of(samples)
    return prompts, ids.cuda(), mask.cuda()


def tree(model, prompts, ids, mask, temperature, with_entropy, pad, attention_backend="flex"):
    return zorro_response_logprobs(model, prompts, ids, mask, temperature, with_entropy, pad,
                                   attention_backend=attention_backend, dedup="tree")


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_tree_flex_fp32_matches_reference(kind):
    batch = tree_batch()
    ref_model = build_tiny(kind, device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    errors = rel_errors(run(tree, twin(ref_model), batch), ref)
    assert max(errors) < 1e-3, errors


def test_tree_flex_bf16_within_naive_error():
    batch = tree_batch()
    ref_model = build_tiny("qwen3", device="cuda")
    ref = run(response_logprobs, ref_model, batch)
    naive = rel_errors(run(response_logprobs, twin(ref_model).to(torch.bfloat16), batch), ref)
    got = rel_errors(run(tree, twin(ref_model).to(torch.bfloat16), batch), ref)
    bad = [(i, z, e) for i, (z, e) in enumerate(zip(got, naive)) if z > 2 * e + 2e-3]
    assert not bad, f"tree bf16 error above 2x naive bf16 error: {bad}"


def test_tree_flex_and_dense_agree_fp32():
    batch = tree_batch()
    model = build_tiny("qwen3", device="cuda")
    flex = run(tree, twin(model), batch)
    dense = run(tree, twin(model), batch, attention_backend="sdpa")
    assert max(rel_errors(flex, dense)) < 1e-4
