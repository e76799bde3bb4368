"""Prefix-tree ZoRRo: exact trie deduplication of a batch (``pack_prefix_tree``), pure functions.

``pack_shared_prompts`` (``packing.py``) shares one level: a group's prompt. Multi-turn and tree
rollouts share prefixes at many depths (a trajectory's first turns shared by all its branches, every
group its prompt, often every prompt its chat template). ``pack_prefix_tree`` builds the trie of the
full token sequences (prompt + response, observation tokens of the response included) and compresses
it into a radix tree: each *segment* is a maximal run of trie nodes with a single child, so a segment
ends only where sequences branch. Every segment is laid out once, in depth-first preorder (children in
order of first appearance), so every token whose prefix several sequences share is computed once:

    sequences  s0 = A B C D    s1 = A B C E F    s2 = A B X    s3 = A B C D (a duplicate)
    tokens      A  B | C | D | E  F | X
    positions   0  1 | 2 | 3 | 3  4 | 2
    segment     0  0 | 1 | 2 | 3  3 | 4
    depth       0  0 | 1 | 2 | 2  2 | 1

Positions are the true positions in the sequence (a trie node's depth is its position). Attention
rule (``tree_masks.py``): a token sees the earlier tokens of its own segment and every token of every
ancestor segment; ``ancestors [S, D + 1]`` holds, per segment, its strict ancestor at each depth
(``NO_ANCESTOR`` at its own depth and beyond). Response token ``t`` of sequence ``i`` (prompt length
``P``) is predicted by the hidden state of the row holding the sequence's token at position
``P + t - 1``, wherever that lies on its path (``predictor_index``, as in ``packing.py``). A sequence
may end inside a segment or at a branch point (budget-truncated branches, one sequence a prefix of
another, duplicates): segments split only where sequences diverge.

A plain GRPO batch whose prompts differ in their first token and whose G responses differ in theirs
packs exactly as ``pack_shared_prompts`` does (same row, segments, parents, predictors); otherwise
the trie shares more (common response openings, common chat templates, identical responses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from arctic_rl.zorro.packing import PROMPT_PARENT, DedupStats, PackedLayout, padded_layout, response_extents

__all__ = ["build_radix_tree", "count_trie_tokens", "pack_prefix_tree", "response_extents", "tree_dedup_stats"]

NO_ANCESTOR = PROMPT_PARENT  # ancestor-table entry past a segment's depth: matches no segment (nor padding)


@dataclass(eq=False)
class _Node:
    """A radix-tree segment: positions ``[start, end)`` of sequence ``source`` (a node's position is
    the same in every sequence through it)."""

    source: int
    start: int
    end: int
    children: dict[int, "_Node"] = field(default_factory=dict)  # first token -> child, in order of first appearance


def _common_prefix(a: list[int], a0: int, b: list[int], b0: int, n: int) -> int:
    """Length of the common prefix of ``a[a0:a0+n]`` and ``b[b0:b0+n]``."""
    if a[a0 : a0 + n] == b[b0 : b0 + n]:
        return n
    m = 0
    while a[a0 + m] == b[b0 + m]:
        m += 1
    return m


def build_radix_tree(sequences: list[list[int]]) -> _Node:
    """The radix tree (compressed trie) of ``sequences``; the root is an empty node. Each insertion
    walks whole segments (one slice comparison each) and splits at most one segment."""
    root = _Node(-1, 0, 0)
    for i, seq in enumerate(sequences):
        node, pos, n = root, 0, len(seq)
        while pos < n:
            child = node.children.get(seq[pos])
            if child is None:
                node.children[seq[pos]] = _Node(i, pos, n)
                break
            size = child.end - child.start
            m = _common_prefix(sequences[child.source], child.start, seq, pos, min(size, n - pos))
            if m == size:
                node, pos = child, pos + m
                continue
            if pos + m < n:  # diverges inside the segment: split it (a sequence ending inside needs no split)
                mid = _Node(child.source, child.start, child.start + m)
                child.start += m
                mid.children[sequences[child.source][child.start]] = child
                mid.children[seq[pos + m]] = _Node(i, pos + m, n)
                node.children[seq[pos]] = mid  # same key: keeps its place in the parent's order
            break
    return root


def _preorder(root: _Node) -> list[tuple[_Node, int]]:
    """``(segment, parent index or -1)`` in depth-first preorder, children in order of first appearance."""
    out: list[tuple[_Node, int]] = []
    stack = [(child, -1) for child in reversed(root.children.values())]
    while stack:
        node, parent = stack.pop()
        out.append((node, parent))
        me = len(out) - 1
        stack += [(child, me) for child in reversed(node.children.values())]
    return out


def pack_prefix_tree(
    prompt_token_ids: list[list[int]],
    response_ids: torch.Tensor,
    lengths: list[int],
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    target_mask: torch.Tensor | None = None,
) -> PackedLayout:
    """Pack sequences ``prompt_i + response_ids[i, :lengths[i]]`` into one trie-deduplicated row.

    Args:
        prompt_token_ids: N prompts, any lengths (at least one token each), no padding.
        response_ids: ``[N, R]`` right-padded responses (only the first ``lengths[i]`` tokens are used).
        lengths: response lengths, holes included (``response_extents(mask)``).
        pad_to_multiple: pad the row to a multiple of this (the FlexAttention block size).
        pad_token_id: token id of that padding (its outputs are never read).
        target_mask: ``[N, R]`` the response tokens whose log-probs are wanted (nonzero); None: all
            ``lengths[i]``. Tokens outside it (observations) are still inputs.

    Sequences with no target are left out. Returns a ``PackedLayout`` with ``ancestors`` set.
    """
    n, r = response_ids.shape
    if len(lengths) != n or len(prompt_token_ids) != n:
        raise ValueError(f"{len(prompt_token_ids)} prompts and {len(lengths)} lengths for {n} responses")
    if any(not 0 <= length <= r for length in lengths):
        raise ValueError(f"response lengths {lengths} must lie in [0, {r}]")
    if target_mask is not None and target_mask.shape != response_ids.shape:
        raise ValueError(f"target_mask {tuple(target_mask.shape)} does not match response_ids {tuple(response_ids.shape)}")
    responses = response_ids.detach().cpu().long()
    within_length = torch.arange(r)[None] < torch.tensor(lengths, dtype=torch.long)[:, None]
    keep = within_length if target_mask is None else within_length & (target_mask.detach().cpu() != 0)
    packed = keep.any(-1).nonzero().flatten().tolist()  # sequences with something to predict
    for i in packed:
        if len(prompt_token_ids[i]) == 0:
            raise ValueError(f"prompt_token_ids[{i}] is empty; every sample needs at least one prompt token")
    rows = responses.tolist()
    sequences = [list(prompt_token_ids[i]) + rows[i][: lengths[i]] for i in packed]
    root = build_radix_tree(sequences)
    segments = _preorder(root)

    # runs in preorder: tokens, positions, segment / parent ids, depths, strict-ancestor chains
    run_len = torch.tensor([node.end - node.start for node, _ in segments], dtype=torch.long)
    run_start = torch.cumsum(run_len, 0) - run_len
    total = int(run_len.sum())
    within = torch.arange(total) - torch.repeat_interleave(run_start, run_len)
    tokens = torch.tensor([t for node, _ in segments for t in sequences[node.source][node.start : node.end]], dtype=torch.long)
    first_pos = torch.tensor([node.start for node, _ in segments], dtype=torch.long)
    positions = torch.repeat_interleave(first_pos, run_len) + within
    parent_of = [parent for _, parent in segments]
    chains: list[list[int]] = []  # strict ancestors of each segment, root first
    for s, parent in enumerate(parent_of):
        chains.append([] if parent < 0 else chains[parent] + [parent])
    width = max((len(c) for c in chains), default=0) + 1
    ancestors = torch.full((len(segments), width), NO_ANCESTOR, dtype=torch.int32)
    for s, chain in enumerate(chains):
        ancestors[s, : len(chain)] = torch.tensor(chain, dtype=torch.int32)
    segment_ids = torch.repeat_interleave(torch.arange(len(segments), dtype=torch.int32), run_len)
    parent_ids = torch.repeat_interleave(
        torch.tensor([PROMPT_PARENT if p < 0 else p for p in parent_of], dtype=torch.int32), run_len
    )

    # each packed sequence's position -> row, over its path of segments
    index = {id(node): s for s, (node, _) in enumerate(segments)}
    piece_row, piece_len, seq_offset = [], [], [0]
    for seq in sequences:
        children, pos = root.children, 0
        while pos < len(seq):
            node = children[seq[pos]]
            take = min(node.end, len(seq)) - pos
            piece_row.append(int(run_start[index[id(node)]]))
            piece_len.append(take)
            pos += take
            children = node.children
        seq_offset.append(seq_offset[-1] + len(seq))
    plen = torch.tensor(piece_len, dtype=torch.long)
    row_of = torch.repeat_interleave(torch.tensor(piece_row, dtype=torch.long), plen)
    row_of = row_of + torch.arange(int(plen.sum())) - torch.repeat_interleave(torch.cumsum(plen, 0) - plen, plen)

    # targets sample-major: response token t of sample i is predicted at its position P_i + t - 1
    keep_packed = keep[packed]
    sample, t = keep_packed.nonzero(as_tuple=True)
    prompt_len = torch.tensor([len(prompt_token_ids[i]) for i in packed], dtype=torch.long)
    predictor = row_of[torch.tensor(seq_offset[:-1], dtype=torch.long)[sample] + prompt_len[sample] + t - 1]
    packed_t = torch.tensor(packed, dtype=torch.long)
    targets = responses[packed_t[sample], t]
    outputs = packed_t[sample] * r + t

    return padded_layout(
        tokens, positions, segment_ids, parent_ids, pad_to_multiple, pad_token_id, response_ids.device,
        predictor_index=predictor, target_ids=targets, output_index=outputs, num_groups=len(root.children),
        naive_tokens=sum(len(p) + length for p, length in zip(prompt_token_ids, lengths)), ancestors=ancestors,
    )


def tree_dedup_stats(prompt_token_ids: list[list[int]], response_ids: torch.Tensor, response_mask: torch.Tensor) -> DedupStats:
    """Naive vs. trie-deduplicated tokens of one prefix-tree forward over these samples (samples with
    no response token are left out of the forward and so not counted as processed)."""
    lengths = response_extents(response_mask)
    rows = response_ids.detach().cpu().tolist()
    has_target = (response_mask != 0).any(-1).tolist()
    sequences = [list(p) + rows[i][: lengths[i]] for i, p in enumerate(prompt_token_ids) if has_target[i]]
    naive = sum(len(p) + length for p, length in zip(prompt_token_ids, lengths))
    return DedupStats(naive_tokens=naive, processed_tokens=count_trie_tokens(sequences))


def count_trie_tokens(sequences: list[list[int]]) -> int:
    """Distinct nodes of the trie of ``sequences`` (the tokens a prefix-tree row holds)."""
    return sum(node.end - node.start for node, _ in _preorder(build_radix_tree(sequences)))
