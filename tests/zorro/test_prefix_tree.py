"""Prefix-tree ZoRRo (``pack_prefix_tree``, ``tree_masks.py``, ``dedup="tree"``): the layout is the
trie of the batch, the masks are the prefix rule, and log-probs, entropies and every parameter's
gradient equal the naive batch's, each sequence run alone through the model's own forward.

Tolerances (tiny random Qwen3 on CPU, sdpa backend): float64 absolute 1e-10 (observed ~1e-14),
float32 absolute 1e-5 on log-probs / entropies, absolute 1e-5 + relative 1e-4 on gradients (packed
vs. unpacked attention sums in a different order). In float64 the RMSNorms run in float64: transformers'
RMSNorm computes in float32 whatever the input dtype, so a shared token's gradient, summed over its
sequences before that float32 backward (packed) or after it (alone), differs by float32 rounding
(~1e-7; the same holds for the shared-prompt path). Forward values agree to ~1e-15 either way."""

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from arctic_rl.zorro import ZorroUnsupportedModel, attention, tree_masks, zorro_response_logprobs
from arctic_rl.zorro.attention import eager_attention, flex_layer_attention
from arctic_rl.zorro.features import AttentionFeatures
from arctic_rl.zorro.logprobs import check_dedup
from arctic_rl.zorro.packed_mask import PackedMask
from arctic_rl.zorro.packing import pack_shared_prompts, response_lengths
from arctic_rl.zorro.prefix_tree import count_trie_tokens, pack_prefix_tree, response_extents, tree_dedup_stats
from arctic_rl.zorro.tree_masks import dense_tree_mask, tree_block_counts, tree_mask_mod

from .models import VOCAB, build_tiny, make_batch, twin

TEMPERATURE = 0.7
TOLERANCES = {torch.float64: (1e-10, 0.0), torch.float32: (1e-5, 1e-4)}  # (absolute, relative on gradients)


def rand(g, n):
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def batch_of(samples):
    """``samples``: ``(prompt, [(tokens, is_target), ...])`` turns -> ``(prompts, response_ids, mask)``;
    turns may be empty; tokens with ``is_target`` False are holes (observations)."""
    prompts = [list(p) for p, _ in samples]
    rows = [[t for tokens, _ in turns for t in tokens] for _, turns in samples]
    targets = [[float(flag) for tokens, flag in turns for _ in tokens] for _, turns in samples]
    r = max(max(len(row) for row in rows), 1)
    ids, mask = torch.zeros(len(rows), r, dtype=torch.long), torch.zeros(len(rows), r)
    for i, (row, flags) in enumerate(zip(rows, targets)):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(flags)] = torch.tensor(flags)
    return prompts, ids, mask


def case_depth3(g):
    system, user1, user2 = rand(g, 4), rand(g, 3), rand(g, 2)
    turn, obs = rand(g, 3), rand(g, 2)
    b = [[10 + k] + rand(g, 2) for k in range(3)]  # distinct first tokens: three branches after the shared turns
    samples = [(system + user1, [(turn, True), (obs, False), (bk, True)]) for bk in b]
    samples += [(system + user2, [([20] + rand(g, 3), True)]), (system + user2, [([21] + rand(g, 2), True)])]
    obs2 = rand(g, 2)  # branch b0 branches again after an observation: segments at depths 0..4
    samples += [(system + user1, [(turn, True), (obs, False), (b[0], True), (obs2, False), ([22 + k] + rand(g, 2), True)])
                for k in range(2)]
    return samples


def case_one_token_branches(g):
    p, x, y = rand(g, 3), rand(g, 2), rand(g, 3)
    return [(p, [(x + [30] + y, True)]), (p, [(x + [31] + y, True)]), (p, [(x + [32], True)]), (p, [([33], True)]),
            (p, [([34], True)])]


def case_empty_turns(g):
    p, a, b, o = rand(g, 4), rand(g, 2), rand(g, 3), rand(g, 2)
    return [
        (p, [(a, True), ([], False), (b, True)]),
        (p, [(a, True), ([], True), (o, False), ([], True), (b, True), ([], False)]),
        (p, []),  # empty response: nothing to predict, left out
        (p, [(o, False)]),  # observations only: nothing to predict, left out
        (rand(g, 2), [([], True)]),
        (p, [([], False), (a, True)]),
    ]


def case_truncated_branches(g):
    p, a, b, c = rand(g, 3), [40] + rand(g, 5), [41] + rand(g, 3), [42] + rand(g, 2)
    return [(p, [(a + b, True)]), (p, [(a[:3], True)]), (p, [(a + c, True)]), (p, [(a + b[:2], True)]),
            (p, [(a[:1], True)])]


def case_duplicates(g):
    p, a, b = rand(g, 3), [43] + rand(g, 4), [44] + rand(g, 2)
    return [(p, [(a, True)]), (p, [(b, True)]), (p, [(a, True)]), (p, [(a, True)])]


def case_prefix_of_another(g):
    p, a, b = rand(g, 3), [45] + rand(g, 3), [46] + rand(g, 3)
    # the second sample's prompt is the first's prompt plus part of its response: shared across the boundary
    return [(p, [(a + b, True)]), (p + a, [(b, True)]), (p, [(a, True)]), (p + a + b[:1], [(b[1:] + [47], True)])]


CASES = {
    "depth3": case_depth3, "one_token_branches": case_one_token_branches, "empty_turns": case_empty_turns,
    "truncated_branches": case_truncated_branches, "duplicates": case_duplicates,
    "prefix_of_another": case_prefix_of_another,
}


def make_case(name, seed=0):
    return batch_of(CASES[name](torch.Generator().manual_seed(seed)))


def sequences_of(prompts, ids, mask):
    lengths = response_extents(mask)
    return [p + ids[i, : lengths[i]].tolist() for i, p in enumerate(prompts)]


def weighted_loss(logprobs, entropy, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(logprobs.shape, generator=g, dtype=torch.float64).to(logprobs.dtype)
    return (w * logprobs).sum() + (torch.randn(entropy.shape, generator=g, dtype=torch.float64).to(entropy.dtype) * entropy).sum()


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_alone(model, prompts, ids, mask):
    """Each sequence alone through ``model``'s own forward: log-probs and entropies ``[N, R]``."""
    n, r = ids.shape
    lengths = response_extents(mask)
    lps, ents = [], []
    for i, prompt in enumerate(prompts):
        lp = ent = torch.zeros(r, dtype=model.dtype)
        if lengths[i]:
            seq = torch.tensor(prompt + ids[i, : lengths[i]].tolist())[None]
            logp = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[0] / TEMPERATURE, -1)
            rows = logp[len(prompt) - 1 : len(prompt) - 1 + lengths[i]]
            pad = (0, r - lengths[i])
            lp = torch.nn.functional.pad(rows.gather(-1, ids[i, : lengths[i], None]).squeeze(-1), pad)
            ent = torch.nn.functional.pad(-(rows.exp() * rows).sum(-1), pad)
        lps.append(lp * mask[i].to(lp.dtype))
        ents.append(ent * mask[i].to(ent.dtype))
    lp, ent = torch.stack(lps), torch.stack(ents)
    weighted_loss(lp, ent).backward()
    return lp.detach(), ent.detach(), grads(model)


def run_packed(model, prompts, ids, mask, dedup="tree", backend="sdpa"):
    lp, ent = zorro_response_logprobs(model, prompts, ids, mask, TEMPERATURE, True, pad_token_id=0,
                                      attention_backend=backend, dedup=dedup)
    weighted_loss(lp, ent).backward()
    return lp.detach(), ent.detach(), grads(model)


def max_gaps(want, got):
    """Largest absolute gaps of log-probs, entropies and (relative to 1 + |g|) gradients."""
    lp = float((want[0] - got[0]).abs().max())
    ent = float((want[1] - got[1]).abs().max())
    assert want[2].keys() == got[2].keys() and len(want[2]) > 0
    grad = max(float(((got[2][k] - g).abs() / (1 + g.abs())).max()) for k, g in want[2].items())
    return lp, ent, grad


def assert_same(want, got, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=atol, rtol=0)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------- layout


def distinct_prefixes(sequences):
    return {tuple(seq[: j + 1]) for seq in sequences for j in range(len(seq))}


@pytest.mark.parametrize("case", list(CASES))
def test_row_holds_each_distinct_prefix_once(case):
    prompts, ids, mask = make_case(case)
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), target_mask=mask)
    kept = [s for s, m in zip(sequences_of(prompts, ids, mask), mask) if m.any()]
    nodes = distinct_prefixes(kept)
    assert layout.num_tokens == layout.processed_tokens == len(nodes) == count_trie_tokens(kept)
    assert tree_dedup_stats(prompts, ids, mask).processed_tokens == len(nodes)
    # each row is one trie node: the path of segments down to it, read with positions
    rows = row_prefixes(layout)
    assert set(rows) == nodes and len(rows) == len(nodes)
    # each target's predictor row holds the sample's prefix ending just before the target
    lengths = response_extents(mask)
    for k, (out, row) in enumerate(zip(layout.output_index.tolist(), layout.predictor_index.tolist())):
        i, t = divmod(out, ids.shape[1])
        assert mask[i, t] == 1 and t < lengths[i] and layout.target_ids[k] == ids[i, t]
        assert rows[row] == tuple(prompts[i] + ids[i, :t].tolist())
    assert layout.output_index.numel() == int(mask.sum())


def row_prefixes(layout):
    """The token prefix (trie node) each row stands for, from segments, ancestors and positions."""
    seg, anc, pos, tok = layout.segment_ids.tolist(), layout.ancestors.tolist(), layout.position_ids.tolist(), layout.input_ids.tolist()
    by_segment = {}
    for row, s in enumerate(seg):
        by_segment.setdefault(s, []).append(tok[row])
    out = []
    for row, s in enumerate(seg):
        path = [a for a in anc[s] if a >= 0]
        prefix = tuple(t for a in path for t in by_segment[a]) + tuple(by_segment[s][: row - seg.index(s) + 1])
        assert len(prefix) == pos[row] + 1
        out.append(prefix)
    return out


def test_depth3_case_is_a_tree_of_depth_three():
    prompts, ids, mask = make_case("depth3")
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), target_mask=mask)
    assert layout.ancestors.shape[1] - 1 == 4  # system, user turn, first turn, branch, sub-branch


def plain_grpo_batch():
    """Two prompts x G = 3, distinct first tokens everywhere: the trie is today's group layout."""
    prompts, ids, mask = make_batch([5, 4], [0, 0, 0, 1, 1, 1], [3, 5, 2, 4, 1, 3])
    prompts = [[50 + (i >= 3)] + p[1:] for i, p in enumerate(prompts)]
    ids[:, 0] = torch.tensor([52, 53, 54, 52, 53, 54])
    return prompts, ids, mask


@pytest.mark.parametrize("pad", [1, 8])
def test_plain_grpo_group_packs_as_shared_prompts(pad):
    prompts, ids, mask = plain_grpo_batch()
    group = pack_shared_prompts(prompts, ids, response_lengths(mask), pad_to_multiple=pad)
    tree = pack_prefix_tree(prompts, ids, response_extents(mask), pad_to_multiple=pad, target_mask=mask)
    for name in ("input_ids", "position_ids", "segment_ids", "parent_ids", "predictor_index", "target_ids", "output_index"):
        assert torch.equal(getattr(tree, name), getattr(group, name)), name
    assert tree.num_groups == group.num_groups == 2 and tree.ancestors.shape == (8, 2)


# ---------------------------------------------------------------- masks


def prefix_rule(layout):
    rows = row_prefixes(layout)
    t = len(rows)
    return torch.tensor([[rows[q][: len(rows[k])] == rows[k] for k in range(t)] for q in range(t)])


@pytest.mark.parametrize("case", list(CASES))
def test_dense_mask_is_the_prefix_rule(case):
    prompts, ids, mask = make_case(case)
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), target_mask=mask)
    assert torch.equal(dense_tree_mask(layout.segment_ids, layout.ancestors)[0, 0], prefix_rule(layout))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size,window", [(2, None), (4, None), (4, 3), (8, 5), (2, 1)])
def test_block_counts_and_mask_mod_equal_the_dense_mask(case, block_size, window):
    prompts, ids, mask = make_case(case)
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), pad_to_multiple=block_size, target_mask=mask)
    seg, anc, pos = layout.segment_ids, layout.ancestors, layout.position_ids
    dense = dense_tree_mask(seg, anc, pos, window)[0, 0]
    nb = seg.shape[0] // block_size
    tiles = dense.view(nb, block_size, nb, block_size)
    any_allowed, all_allowed = tree_block_counts(seg, anc, block_size, pos, window)
    assert torch.equal(any_allowed, tiles.any(3).any(1)) and torch.equal(all_allowed, tiles.all(3).all(1))
    t = seg.shape[0]
    q, k = torch.arange(t)[:, None].expand(t, t), torch.arange(t)[None].expand(t, t)
    assert torch.equal(tree_mask_mod(seg, anc, pos, window)(0, 0, q, k), dense)


@pytest.mark.parametrize("chunk", [1, 1000])
def test_block_counts_in_query_chunks_equal_one_pass(monkeypatch, chunk):
    prompts, ids, mask = make_case("depth3")
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), pad_to_multiple=2, target_mask=mask)
    args = (layout.segment_ids, layout.ancestors, 2, layout.position_ids, 3)
    whole = tree_block_counts(*args)
    monkeypatch.setattr(tree_masks, "QUERY_CHUNK_ELEMENTS", chunk)  # one query block (or a few) per chunk
    chunked = tree_block_counts(*args)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("window", [None, 4])
def test_flex_block_mask_forward_equals_eager(monkeypatch, window):
    """Eager flex on CPU (no CPU backward; compiled flex needs a GPU) over a row of 128-blocks."""
    monkeypatch.setattr(attention, "compiled_flex_attention", lambda: flex_attention)
    g = torch.Generator().manual_seed(3)
    system = rand(g, 90)
    samples = [(system + rand(g, 20), [(rand(g, 60), True), (rand(g, 10), False), (rand(g, 30 + 7 * k), True)]) for k in range(3)]
    samples += [(samples[0][0], [(samples[0][1][0][0] + rand(g, 40), True)])]
    prompts, ids, mask = batch_of(samples)
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), pad_to_multiple=128, target_mask=mask)
    packed = PackedMask.of(layout, "sdpa", (AttentionFeatures(),), "test")
    t = packed.num_tokens
    q = torch.randn(1, 4, t, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, t, 16, generator=g, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        want = eager_attention(q, k, v, packed.dense_mask(window), 0.25)
        got = flex_layer_attention(q, k, v, packed.block_mask(window), 0.25)
    real = packed.segment_ids >= 0
    torch.testing.assert_close(got[0, real], want[0, real], atol=1e-12, rtol=0)


# ---------------------------------------------------------------- exactness against each sequence alone


def rms_norm_in_input_dtype(self, hidden_states):
    """Qwen3's RMSNorm without its float32 round trip (same formula)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", [*CASES, "plain_grpo_group"])
def test_logprobs_and_gradients_equal_each_sequence_alone(monkeypatch, case, dtype):
    if dtype == torch.float64:
        from transformers.models.qwen3 import modeling_qwen3

        monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", rms_norm_in_input_dtype)
    prompts, ids, mask = plain_grpo_batch() if case == "plain_grpo_group" else make_case(case)
    model = build_tiny("qwen3", dtype=dtype)
    want = run_alone(model, prompts, ids, mask)
    got = run_packed(twin(model), prompts, ids, mask)
    assert_same(want, got, dtype)
    assert torch.all(got[0][mask == 0] == 0) and torch.all(got[1][mask == 0] == 0)


def test_plain_grpo_group_tree_equals_group_path_exactly():
    prompts, ids, mask = plain_grpo_batch()
    model = build_tiny("qwen3", dtype=torch.float64)
    group = run_packed(twin(model), prompts, ids, mask, dedup="group")
    tree = run_packed(twin(model), prompts, ids, mask, dedup="tree")
    assert torch.equal(group[0], tree[0]) and torch.equal(group[1], tree[1])
    assert all(torch.equal(group[2][k], tree[2][k]) for k in group[2])


# ---------------------------------------------------------------- refusals


def test_cascade_backends_and_unknown_modes_refuse_tree_rows():
    for backend in ("cudnn", "flash_varlen"):
        with pytest.raises(ValueError, match="flex or sdpa"):
            check_dedup("tree", backend)
    with pytest.raises(ValueError, match="group.*tree"):
        check_dedup("trie", "sdpa")
    prompts, ids, mask = make_case("depth3")
    layout = pack_prefix_tree(prompts, ids, response_extents(mask), target_mask=mask)
    with pytest.raises(ValueError, match="cascade kernels"):
        PackedMask.of(layout, "cudnn", (AttentionFeatures(),), "test", plan=object())


def test_hybrid_linear_attention_model_refuses_tree_rows():
    prompts, ids, mask = make_case("depth3")
    with pytest.raises(ZorroUnsupportedModel, match="zorro_dedup: group"):
        zorro_response_logprobs(build_tiny("qwen3_5_text"), prompts, ids, mask, 1.0, False, 0, "sdpa", dedup="tree")
