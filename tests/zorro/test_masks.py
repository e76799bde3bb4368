"""The ZoRRo attention rule, densely and as FlexAttention blocks, on a hand-drawn row."""

import pytest
import torch

from arctic_rl.zorro.masks import block_counts, dense_zorro_mask, zorro_block_mask, zorro_mask_mod
from arctic_rl.zorro.packing import pack_shared_prompts

# prompt p (3 tokens) with responses a (2) and b (1), then prompt q (1) with response c (1)
LAYOUT = pack_shared_prompts([[10, 11, 12], [20], [10, 11, 12]], torch.tensor([[1, 2], [5, 0], [3, 0]]), [2, 1, 1])
#              p p p a a b q c
EXPECTED = [
    [1, 0, 0, 0, 0, 0, 0, 0],  # p0
    [1, 1, 0, 0, 0, 0, 0, 0],  # p1
    [1, 1, 1, 0, 0, 0, 0, 0],  # p2
    [1, 1, 1, 1, 0, 0, 0, 0],  # a0: prompt + itself
    [1, 1, 1, 1, 1, 0, 0, 0],  # a1
    [1, 1, 1, 0, 0, 1, 0, 0],  # b0: prompt + itself, not a
    [0, 0, 0, 0, 0, 0, 1, 0],  # q0
    [0, 0, 0, 0, 0, 0, 1, 1],  # c0
]


def test_dense_mask_matches_hand_drawn_rule():
    assert LAYOUT.input_ids.tolist() == [10, 11, 12, 1, 2, 3, 20, 5]
    mask = dense_zorro_mask(LAYOUT.segment_ids, LAYOUT.parent_ids)
    assert mask.shape == (1, 1, 8, 8)
    assert mask[0, 0].int().tolist() == EXPECTED


def test_block_counts_with_2x2_blocks():
    any_allowed, all_allowed = block_counts(LAYOUT.segment_ids, LAYOUT.parent_ids, block_size=2)
    # 2x2 tiles of EXPECTED: any / all
    assert any_allowed.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]
    assert all_allowed.int().tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_block_counts_equal_tiles_of_the_dense_mask(seed, block_size):
    g = torch.Generator().manual_seed(seed)
    prompt_of = torch.randint(0, 3, (7,), generator=g).tolist()
    lengths = torch.randint(0, 9, (7,), generator=g).tolist()
    prompts = [[k + 1] * (k * 3 + 2) for k in range(3)]
    layout = pack_shared_prompts([prompts[k] for k in prompt_of], torch.ones(7, 8, dtype=torch.long), lengths, block_size)
    seg, par = layout.segment_ids, layout.parent_ids
    nb = seg.shape[0] // block_size
    tiles = dense_zorro_mask(seg, par)[0, 0].view(nb, block_size, nb, block_size)
    any_allowed, all_allowed = block_counts(seg, par, block_size)
    assert torch.equal(any_allowed, tiles.any(3).any(1)) and torch.equal(all_allowed, tiles.all(3).all(1))


def test_block_mask_and_mask_mod_agree_with_dense():
    layout = pack_shared_prompts([[1] * 5, [2] * 3] * 3, torch.ones(6, 7, dtype=torch.long), [7, 2, 3, 4, 1, 6], 4)
    seg, par = layout.segment_ids, layout.parent_ids
    dense = dense_zorro_mask(seg, par)[0, 0]
    block_mask = zorro_block_mask(seg, par, block_size=4)
    any_allowed, _ = block_counts(seg, par, 4)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), any_allowed)  # computed blocks = blocks with any pair
    t = seg.shape[0]
    q, k = torch.arange(t)[:, None].expand(t, t), torch.arange(t)[None].expand(t, t)
    assert torch.equal(zorro_mask_mod(seg, par)(0, 0, q, k), dense)


# the same row with window 2: a token sees itself and one position back in its own sequence
# (prompt positions 0..2, a at 3..4, b at 3, q at 0, c at 1)
EXPECTED_WINDOW_2 = [
    [1, 0, 0, 0, 0, 0, 0, 0],  # p0 (position 0)
    [1, 1, 0, 0, 0, 0, 0, 0],  # p1
    [0, 1, 1, 0, 0, 0, 0, 0],  # p2
    [0, 0, 1, 1, 0, 0, 0, 0],  # a0 (position 3): p2 and itself
    [0, 0, 0, 1, 1, 0, 0, 0],  # a1 (position 4): a0 and itself, no prompt left
    [0, 0, 1, 0, 0, 1, 0, 0],  # b0 (position 3): p2 and itself, never a
    [0, 0, 0, 0, 0, 0, 1, 0],  # q0
    [0, 0, 0, 0, 0, 0, 1, 1],  # c0
]


def test_windowed_dense_mask_matches_hand_drawn_rule():
    mask = dense_zorro_mask(LAYOUT.segment_ids, LAYOUT.parent_ids, LAYOUT.position_ids, window=2)
    assert mask[0, 0].int().tolist() == EXPECTED_WINDOW_2


@pytest.mark.parametrize("window", [1, 2, 3, 5, 11])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_windowed_block_counts_and_mask_mod_equal_the_dense_mask(seed, block_size, window):
    g = torch.Generator().manual_seed(seed)
    prompt_of = torch.randint(0, 3, (7,), generator=g).tolist()
    lengths = torch.randint(0, 9, (7,), generator=g).tolist()
    prompts = [[k + 1] * (k * 3 + 2) for k in range(3)]
    layout = pack_shared_prompts([prompts[k] for k in prompt_of], torch.ones(7, 8, dtype=torch.long), lengths, block_size)
    seg, par, pos = layout.segment_ids, layout.parent_ids, layout.position_ids
    dense = dense_zorro_mask(seg, par, pos, window)[0, 0]
    nb = seg.shape[0] // block_size
    tiles = dense.view(nb, block_size, nb, block_size)
    any_allowed, all_allowed = block_counts(seg, par, block_size, pos, window)
    assert torch.equal(any_allowed, tiles.any(3).any(1)) and torch.equal(all_allowed, tiles.all(3).all(1))
    t = seg.shape[0]
    q, k = torch.arange(t)[:, None].expand(t, t), torch.arange(t)[None].expand(t, t)
    assert torch.equal(zorro_mask_mod(seg, par, pos, window)(0, 0, q, k), dense)
    block_mask = zorro_block_mask(seg, par, block_size, pos, window)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), any_allowed)


def test_window_needs_positions():
    with pytest.raises(ValueError, match="position_ids"):
        dense_zorro_mask(LAYOUT.segment_ids, LAYOUT.parent_ids, window=2)
