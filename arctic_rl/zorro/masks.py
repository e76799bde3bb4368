"""Attention masks of a packed ZoRRo row: a dense boolean reference and a FlexAttention BlockMask.

``allowed(q, k) = (segment[k] == segment[q] and k <= q) or segment[k] == parent[q]``: a token sees
earlier tokens of its own prompt / response and the whole prompt of its group (``packing.py``).
A sliding-window layer (``window = W``, ``features.py``) also requires ``position[q] - position[k]
< W``: positions restart in every sequence (prompt ``0..P-1``, each response ``P..``), so each
token keeps exactly the keys its own unpacked sequence would give it.

The BlockMask is built from block-level counts computed here, not by ``create_block_mask``'s
tracing: every query sees two key intervals (its segment so far, its group's prompt), so counting
visible keys per key block costs ``T x T/block`` and no ``T x T`` mask is formed.
A block is *full* when every pair in it is allowed (FlexAttention then skips the mask function),
*partial* when some are, and skipped entirely when none is: with responses of a few hundred tokens
and 128-token blocks, response-to-other-response tiles are never computed.
"""

from __future__ import annotations

import torch


def check_window(position_ids: torch.Tensor | None, window: int | None) -> None:
    if window is not None and (position_ids is None or window < 1):
        raise ValueError(f"a sliding window needs position_ids and window >= 1, got window={window}")


def allowed_pairs(segment_ids: torch.Tensor, parent_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                  window: int | None = None) -> torch.Tensor:
    """``[T, T]`` boolean attention rule, queries x keys (the reference; ``T x T`` memory)."""
    check_window(position_ids, window)
    q = torch.arange(segment_ids.shape[0], device=segment_ids.device)[:, None]
    k = q.T
    own = (segment_ids[:, None] == segment_ids[None]) & (k <= q)
    allowed = own | (parent_ids[:, None] == segment_ids[None])
    if window is not None:
        allowed &= position_ids[:, None] - position_ids[None] < window
    return allowed


def dense_zorro_mask(segment_ids: torch.Tensor, parent_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     window: int | None = None) -> torch.Tensor:
    """``[1, 1, T, T]`` boolean mask (True = attend) for SDPA / eager attention."""
    return allowed_pairs(segment_ids, parent_ids, position_ids, window)[None, None]


def zorro_mask_mod(segment_ids: torch.Tensor, parent_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                   window: int | None = None):
    """The FlexAttention ``mask_mod`` of the rule (evaluated only inside partial blocks)."""
    check_window(position_ids, window)

    def mask_mod(batch, head, q_idx, kv_idx):
        own = (segment_ids[q_idx] == segment_ids[kv_idx]) & (kv_idx <= q_idx)
        return own | (parent_ids[q_idx] == segment_ids[kv_idx])

    if window is None:
        return mask_mod

    def windowed_mask_mod(batch, head, q_idx, kv_idx):
        return mask_mod(batch, head, q_idx, kv_idx) & (position_ids[q_idx] - position_ids[kv_idx] < window)

    return windowed_mask_mod


def key_intervals(segment_ids: torch.Tensor, parent_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                  window: int | None = None) -> tuple[torch.Tensor, ...]:
    """Per query token, the keys it may see as two disjoint intervals ``[own_start, q + 1)`` (its
    segment so far) and ``[parent_start, parent_end)`` (its group's prompt, empty for prompts).
    Segments are contiguous runs in the row and a prompt precedes its responses (``packing.py``).
    With a window both intervals lose their keys at positions ``<= position[q] - window`` (rows and
    positions advance together inside a segment, and a prompt's positions start at 0)."""
    check_window(position_ids, window)
    t = segment_ids.shape[0]
    index = torch.arange(t, device=segment_ids.device)
    new_run = torch.ones(t, dtype=torch.bool, device=segment_ids.device)
    new_run[1:] = segment_ids[1:] != segment_ids[:-1]
    own_start = torch.cummax(torch.where(new_run, index, 0), dim=0).values
    # first / one-past-last position of every segment id 0..S-1; padding (-1) goes to a spare slot S
    size = int(segment_ids.max()) + 1 if t else 0
    ids = torch.where(segment_ids >= 0, segment_ids.long(), size)
    seg_start = torch.full((size + 1,), t, device=segment_ids.device).scatter_reduce(0, ids, index, "amin")
    seg_end = torch.zeros(size + 1, dtype=torch.long, device=segment_ids.device).scatter_reduce(0, ids, index + 1, "amax")
    has_parent = parent_ids >= 0
    parent = parent_ids.long().clamp_min(0)
    parent_start = torch.where(has_parent, seg_start[parent], 0)
    parent_end = torch.where(has_parent, seg_end[parent], 0)
    if window is not None:
        first_visible = position_ids.long() - window + 1  # lowest position still inside the window
        real = segment_ids >= 0  # padding keeps its plain rule, as in the dense mask (its positions are all 0)
        own_start = torch.where(real, torch.maximum(own_start, index - window + 1), own_start)
        parent_start = torch.minimum(parent_start + first_visible.clamp_min(0), parent_end)
    return own_start, index + 1, parent_start, parent_end


def block_counts(segment_ids: torch.Tensor, parent_ids: torch.Tensor, block_size: int,
                 position_ids: torch.Tensor | None = None, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(any_allowed, all_allowed)``, each ``[T/bs, T/bs]`` bool, for a row padded to a multiple of
    ``block_size``. Costs ``T x T/bs``: each query's visible keys per key block are counted from
    its two intervals, so no ``T x T`` mask is ever formed."""
    t = segment_ids.shape[0]
    if t % block_size:
        raise ValueError(f"packed length {t} is not a multiple of block_size {block_size}; pack with pad_to_multiple")
    nb = t // block_size
    own_start, own_end, parent_start, parent_end = key_intervals(segment_ids, parent_ids, position_ids, window)
    k0 = torch.arange(nb, device=segment_ids.device) * block_size
    k1 = k0 + block_size

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # [T, nb] keys of each block inside [lo, hi)
        return (torch.minimum(hi[:, None], k1[None]) - torch.maximum(lo[:, None], k0[None])).clamp_min(0)

    visible = (overlap(own_start, own_end) + overlap(parent_start, parent_end)).view(nb, block_size, nb)
    return (visible > 0).any(dim=1), (visible == block_size).all(dim=1)


def indices_first(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: how many blocks are selected, and block indices with the selected ones first (ascending)."""
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True)
    return selected.sum(-1).to(torch.int32)[None, None], order.to(torch.int32)[None, None]


def zorro_block_mask(segment_ids: torch.Tensor, parent_ids: torch.Tensor, block_size: int = 128,
                     position_ids: torch.Tensor | None = None, window: int | None = None):
    """A FlexAttention ``BlockMask`` (batch 1, broadcast over heads) of the ZoRRo rule."""
    from torch.nn.attention.flex_attention import BlockMask

    any_allowed, all_allowed = block_counts(segment_ids, parent_ids, block_size, position_ids, window)
    kv_num, kv_idx = indices_first(any_allowed & ~all_allowed)
    full_num, full_idx = indices_first(all_allowed)
    t = segment_ids.shape[0]
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=zorro_mask_mod(segment_ids, parent_ids, position_ids, window), seq_lengths=(t, t),
    )
