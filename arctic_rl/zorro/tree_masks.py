"""Attention masks of a prefix-tree row (``prefix_tree.py``): a dense boolean reference, the
FlexAttention ``mask_mod`` and a ``BlockMask`` from block-level counts.

Rule, with ``ancestors [S, D + 1]`` each segment's strict ancestor at each depth (``NO_ANCESTOR``
from its own depth on) and ``depth(s)`` its number of ancestors::

    allowed(q, k) = (segment[k] == segment[q] and k <= q)
                    or segment[k] == ancestors[segment[q], depth(segment[k])]

A token sees the earlier tokens of its own segment and every token of each segment on its path from
the root. Padding (``PAD_SEGMENT``) sees earlier padding only and is seen by nothing, as in
``masks.py``. A sliding window (``window = W``) also requires ``position[q] - position[k] < W``:
positions are the true sequence positions, so each token keeps exactly its unpacked keys.

For the block mask every query sees at most ``D + 1`` disjoint key intervals (its segment so far and
each ancestor segment, each a contiguous run of the row); visible keys per key block are summed over
them, a chunk of query blocks at a time (bounded memory, no ``T x T`` mask).
"""

from __future__ import annotations

import torch

from arctic_rl.zorro.masks import check_window, indices_first
from arctic_rl.zorro.packing import PROMPT_PARENT

QUERY_CHUNK_ELEMENTS = 1 << 24  # block counting works on [query rows, intervals, key blocks] chunks of about this size


def _token_tables(segment_ids: torch.Tensor, ancestors: torch.Tensor):
    """``(segment, row base, depth, flat table)`` per token: ``flat[base[q] + depth[k]]`` is ``q``'s
    ancestor at ``k``'s depth; padding reads a spare row of ``NO_ANCESTOR`` and has depth 0."""
    num_segments, width = ancestors.shape
    seg = segment_ids.long()
    real = seg >= 0
    safe = seg.clamp_min(0)
    depth = (ancestors >= 0).sum(-1)  # strict ancestors fill depths 0..depth-1
    flat = torch.cat([ancestors.flatten(), torch.full((width,), PROMPT_PARENT, dtype=ancestors.dtype, device=ancestors.device)])
    base = torch.where(real, safe, num_segments) * width
    tok_depth = torch.where(real, depth[safe] if num_segments else torch.zeros_like(seg), 0)
    return seg, base, tok_depth, flat.long()


def tree_allowed_pairs(segment_ids: torch.Tensor, ancestors: torch.Tensor, position_ids: torch.Tensor | None = None,
                       window: int | None = None) -> torch.Tensor:
    """``[T, T]`` boolean tree rule, queries x keys (the reference; ``T x T`` memory)."""
    check_window(position_ids, window)
    seg, base, depth, flat = _token_tables(segment_ids, ancestors)
    q = torch.arange(seg.shape[0], device=seg.device)[:, None]
    allowed = ((seg[:, None] == seg[None]) & (q.T <= q)) | (flat[base[:, None] + depth[None]] == seg[None])
    if window is not None:
        allowed &= position_ids[:, None] - position_ids[None] < window
    return allowed


def dense_tree_mask(segment_ids: torch.Tensor, ancestors: torch.Tensor, position_ids: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean mask (True = attend) for SDPA / eager attention."""
    return tree_allowed_pairs(segment_ids, ancestors, position_ids, window)[None, None]


def tree_mask_mod(segment_ids: torch.Tensor, ancestors: torch.Tensor, position_ids: torch.Tensor | None = None,
                  window: int | None = None):
    """The FlexAttention ``mask_mod`` of the tree rule (evaluated only inside partial blocks)."""
    check_window(position_ids, window)
    seg, base, depth, flat = _token_tables(segment_ids, ancestors)

    def mask_mod(batch, head, q_idx, kv_idx):
        own = (seg[q_idx] == seg[kv_idx]) & (kv_idx <= q_idx)
        return own | (flat[base[q_idx] + depth[kv_idx]] == seg[kv_idx])

    if window is None:
        return mask_mod

    def windowed_mask_mod(batch, head, q_idx, kv_idx):
        return mask_mod(batch, head, q_idx, kv_idx) & (position_ids[q_idx] - position_ids[kv_idx] < window)

    return windowed_mask_mod


def tree_block_counts(segment_ids: torch.Tensor, ancestors: torch.Tensor, block_size: int,
                      position_ids: torch.Tensor | None = None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any_allowed, all_allowed)``, each ``[T/bs, T/bs]`` bool, for a row padded to a multiple of
    ``block_size``: visible keys per (query, key block), summed over the query's own interval and its
    ancestors' intervals, then reduced over each query block."""
    check_window(position_ids, window)
    t = segment_ids.shape[0]
    if t % block_size:
        raise ValueError(f"packed length {t} is not a multiple of block_size {block_size}; pack with pad_to_multiple")
    device, nb = segment_ids.device, t // block_size
    seg, base, _, flat = _token_tables(segment_ids, ancestors)
    index = torch.arange(t, device=device)
    new_run = torch.ones(t, dtype=torch.bool, device=device)
    new_run[1:] = seg[1:] != seg[:-1]
    own_start = torch.cummax(torch.where(new_run, index, 0), dim=0).values
    # first row / one past the last / first position of each segment 0..S-1, spare slot S for padding and "none"
    size = ancestors.shape[0]
    ids = torch.where(seg >= 0, seg, size)
    seg_start = torch.full((size + 1,), t, device=device).scatter_reduce(0, ids, index, "amin")
    seg_end = torch.zeros(size + 1, dtype=torch.long, device=device).scatter_reduce(0, ids, index + 1, "amax")
    seg_pos0 = torch.zeros(size + 1, dtype=torch.long, device=device)
    if window is not None:
        seg_pos0 = seg_pos0.scatter_reduce(0, ids, position_ids.long(), "amin", include_self=False)
        first_visible = position_ids.long() - window + 1  # lowest position still inside the window
        own_start = torch.where(seg >= 0, torch.maximum(own_start, index - window + 1), own_start)
    starts, ends = [own_start], [index + 1]  # per query: its own segment so far, then each ancestor segment
    for d in range(ancestors.shape[1]):
        anc = flat[base + d]
        slot = torch.where(anc >= 0, anc, size)
        start, end = torch.where(anc >= 0, seg_start[slot], 0), torch.where(anc >= 0, seg_end[slot], 0)
        if window is not None:
            start = torch.minimum(start + (first_visible - seg_pos0[slot]).clamp_min(0), end)
        starts.append(start)
        ends.append(end)
    lo, hi = torch.stack(starts, 1), torch.stack(ends, 1)  # [T, D + 2] disjoint intervals
    k0 = torch.arange(nb, device=device) * block_size
    k1 = k0 + block_size
    any_allowed = torch.empty(nb, nb, dtype=torch.bool, device=device)
    all_allowed = torch.empty(nb, nb, dtype=torch.bool, device=device)
    step = max(1, QUERY_CHUNK_ELEMENTS // (block_size * nb * lo.shape[1]))  # query blocks per chunk: bounded memory
    for b0 in range(0, nb, step):
        rows = slice(b0 * block_size, min(b0 + step, nb) * block_size)
        # keys of each key block inside each interval, summed over the intervals: [rows, nb]
        overlap = torch.minimum(hi[rows, :, None], k1) - torch.maximum(lo[rows, :, None], k0)
        visible = overlap.clamp_min_(0).sum(1).view(-1, block_size, nb)
        any_allowed[b0 : b0 + step] = (visible > 0).any(dim=1)
        all_allowed[b0 : b0 + step] = (visible == block_size).all(dim=1)
    return any_allowed, all_allowed


def tree_block_mask(segment_ids: torch.Tensor, ancestors: torch.Tensor, block_size: int = 128,
                    position_ids: torch.Tensor | None = None, window: int | None = None):
    """A FlexAttention ``BlockMask`` (batch 1, broadcast over heads) of the tree rule."""
    from torch.nn.attention.flex_attention import BlockMask

    any_allowed, all_allowed = tree_block_counts(segment_ids, ancestors, block_size, position_ids, window)
    kv_num, kv_idx = indices_first(any_allowed & ~all_allowed)
    full_num, full_idx = indices_first(all_allowed)
    t = segment_ids.shape[0]
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(segment_ids, ancestors, position_ids, window), seq_lengths=(t, t),
    )
