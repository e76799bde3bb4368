"""Prompt-deduplicated packing: pure functions from (prompt ids, response ids) to one packed row.

A batch of GRPO samples repeats each prompt G times. ``pack_shared_prompts`` finds the samples that
share an identical prompt (a dict keyed by the token-id tuple, so hashing with exact equality) and
lays each group out once, ``[P, R_1, ..., R_G]``, groups one after another in one row:

    tokens     p0 p1 p2 | a0 a1 | b0 b1 b2 || q0 q1 | c0
    positions   0  1  2 |  3  4 |  3  4  5 ||  0  1 |  2
    segment     0  0  0 |  1  1 |  2  2  2 ||  3  3 |  4
    parent     -2 -2 -2 |  0  0 |  0  0  0 || -2 -2 |  3

Attention rule (see ``masks.py``): a token sees earlier tokens of its own segment and every token of
its ``parent`` segment (the group's prompt). Response token t of a sample is predicted by the hidden
state of the prompt's last token (t = 0) or of its own token t - 1; ``predictor_index`` holds those
row positions in the original sample order, so results come back in the caller's layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PROMPT_PARENT = -2  # parent id of prompt (and padding) tokens: matches no segment
PAD_SEGMENT = -1  # segment id of padding appended to reach a length multiple


@dataclass(frozen=True)
class PackedLayout:
    """One packed row of ``T`` tokens covering ``M`` response tokens of ``N`` samples."""

    input_ids: torch.Tensor  # [T] long
    position_ids: torch.Tensor  # [T] long, prompt 0..P-1, every response P..P+|R_i|-1
    segment_ids: torch.Tensor  # [T] int32, one id per prompt / response, PAD_SEGMENT on padding
    parent_ids: torch.Tensor  # [T] int32, the group's prompt segment for response tokens, else PROMPT_PARENT
    predictor_index: torch.Tensor  # [M] long, row position whose hidden state predicts each response token
    target_ids: torch.Tensor  # [M] long, the response tokens, sample-major
    output_index: torch.Tensor  # [M] long, flat index into [N, R] where each result goes
    num_groups: int  # distinct prompts packed
    naive_tokens: int  # sum over samples of P_i + |R_i| (the per-sequence work)
    # prefix-tree layouts (``prefix_tree.py``): [S, D + 1] int32, each segment's strict ancestor at each depth
    # (NO_ANCESTOR from its own depth on); None: a shared-prompt layout, the rule of ``parent_ids``
    ancestors: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Packed row length including padding."""
        return self.input_ids.shape[0]

    @property
    def processed_tokens(self) -> int:
        """Real (non-padding) tokens in the row."""
        return int((self.segment_ids != PAD_SEGMENT).sum())


@dataclass(frozen=True)
class DedupStats:
    """Token counts of a batch: per-sequence (naive) vs. prompt-deduplicated (processed)."""

    naive_tokens: int
    processed_tokens: int

    @property
    def ratio(self) -> float:
        return self.naive_tokens / max(self.processed_tokens, 1)

    def as_metrics(self, prefix: str = "zorro/") -> dict[str, float]:
        return {
            f"{prefix}naive_tokens": float(self.naive_tokens),
            f"{prefix}processed_tokens": float(self.processed_tokens),
            f"{prefix}dedup_ratio": self.ratio,
        }


def response_lengths(response_mask: torch.Tensor) -> list[int]:
    """Lengths of the right-padded responses in ``response_mask [N, R]``; errors on holes in a mask."""
    lengths = response_mask.sum(-1).long()
    arange = torch.arange(response_mask.shape[1], device=response_mask.device)
    prefix = (arange[None] < lengths[:, None]).to(response_mask.dtype)
    bad = (prefix != response_mask).any(-1).nonzero().flatten()
    if bad.numel():
        raise ValueError(f"response_mask row {int(bad[0])} is not a right-padded prefix of ones (1...1 0...0)")
    return lengths.tolist()


def response_extents(response_mask: torch.Tensor) -> list[int]:
    """Per row of ``response_mask [N, R]``, one past its last nonzero entry (0 for none): the response's
    length in tokens, holes (observation tokens, which are inputs but not targets) included."""
    r = response_mask.shape[1]
    index = torch.arange(1, r + 1, device=response_mask.device)
    if r == 0:
        return [0] * response_mask.shape[0]
    return torch.where(response_mask != 0, index, 0).amax(-1).long().tolist()


def group_by_prompt(prompt_token_ids: list[list[int]]) -> list[list[int]]:
    """Sample indices grouped by identical prompt, groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    seen: dict[int, tuple[int, ...]] = {}  # id of a prompt object -> its key: a group's G samples often share one list
    for i, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt_token_ids[{i}] is empty; every sample needs at least one prompt token")
        key = seen.get(id(prompt))
        if key is None:
            key = seen[id(prompt)] = tuple(prompt)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def dedup_stats(prompt_token_ids: list[list[int]], response_mask: torch.Tensor) -> DedupStats:
    """Naive vs. processed tokens of one ZoRRo forward over these samples (groups with no response
    tokens are skipped by the forward and so not counted as processed). Responses count to their
    extent (``response_extents``: holes in the mask are tokens too)."""
    lengths = response_extents(response_mask)
    naive = sum(len(p) + r for p, r in zip(prompt_token_ids, lengths))
    processed = 0
    for group in group_by_prompt(prompt_token_ids):
        group_tokens = sum(lengths[i] for i in group)
        if group_tokens:
            processed += len(prompt_token_ids[group[0]]) + group_tokens
    return DedupStats(naive_tokens=naive, processed_tokens=processed)


def pack_shared_prompts(
    prompt_token_ids: list[list[int]],
    response_ids: torch.Tensor,
    lengths: list[int],
    pad_to_multiple: int = 1,
    pad_token_id: int = 0,
    prompts_first: bool = False,
) -> PackedLayout:
    """Pack samples ``(prompt_i, response_ids[i, :lengths[i]])`` into one deduplicated row.

    Args:
        prompt_token_ids: N prompts, any lengths, no padding.
        response_ids: ``[N, R]`` right-padded responses (only the first ``lengths[i]`` tokens are used).
        lengths: response lengths (``response_lengths(mask)``).
        pad_to_multiple: pad the row to a multiple of this (the FlexAttention block size).
        pad_token_id: token id of that padding (its outputs are never read).
        prompts_first: lay out every group's prompt first, then every group's responses in the
            same group order (``[P_1, P_2, R_1.., R_2..]``, the cascade-attention layout) instead of
            ``[P_1, R_1.., P_2, R_2..]``. Same segments and attention rule either way.

    Built with tensor ops over runs (one run per prompt / response), not per token.
    """
    n, r = response_ids.shape
    if len(lengths) != n or len(prompt_token_ids) != n:
        raise ValueError(f"{len(prompt_token_ids)} prompts and {len(lengths)} lengths for {n} responses")
    responses = response_ids.detach().cpu()
    groups = [group for group in group_by_prompt(prompt_token_ids) if any(lengths[i] for i in group)]
    # runs in segment order: (source tokens, length, segment, parent, first position); groups whose
    # responses are all empty are skipped (nothing to predict), empty responses still take a segment id
    prompt_runs, response_runs = [], []
    sample_segment, sample_prompt = {}, {}
    segment = 0
    for group in groups:
        prompt = torch.tensor(prompt_token_ids[group[0]], dtype=torch.long)
        prompt_segment = segment
        prompt_runs.append((prompt, len(prompt), prompt_segment, PROMPT_PARENT, 0))
        segment += 1
        for i in group:
            response_runs.append((responses[i, : lengths[i]], lengths[i], segment, prompt_segment, len(prompt)))
            sample_segment[i], sample_prompt[i] = segment, prompt_segment
            segment += 1
    if prompts_first:
        runs = prompt_runs + response_runs
    else:
        runs, k = [], 0
        for g, group in enumerate(groups):
            runs.append(prompt_runs[g])
            runs += response_runs[k : k + len(group)]
            k += len(group)
    run_len = torch.tensor([run[1] for run in runs], dtype=torch.long)
    run_start = torch.cumsum(run_len, 0) - run_len  # row offset of each run
    total = int(run_len.sum())
    within = torch.arange(total) - torch.repeat_interleave(run_start, run_len)
    tokens = torch.cat([run[0] for run in runs]) if runs else torch.zeros(0, dtype=torch.long)
    positions = torch.repeat_interleave(torch.tensor([run[4] for run in runs], dtype=torch.long), run_len) + within
    segments = torch.repeat_interleave(torch.tensor([run[2] for run in runs], dtype=torch.int32), run_len)
    parents = torch.repeat_interleave(torch.tensor([run[3] for run in runs], dtype=torch.int32), run_len)

    # response tokens in sample-major order: targets, where results go, and the predicting row
    seg_row = {run[2]: int(start) for run, start in zip(runs, run_start)}
    seg_len = {run[2]: run[1] for run in runs}
    lens = torch.tensor(lengths, dtype=torch.long)
    keep = torch.arange(r)[None] < lens[:, None]
    targets = responses.long()[keep]
    outputs = keep.flatten().nonzero().flatten()
    packed = [i for i in range(n) if lengths[i]]
    plens = torch.tensor([lengths[i] for i in packed], dtype=torch.long)
    resp_row = torch.tensor([seg_row[sample_segment[i]] for i in packed], dtype=torch.long)
    prompt_last = torch.tensor([seg_row[sample_prompt[i]] + seg_len[sample_prompt[i]] - 1 for i in packed], dtype=torch.long)
    t = torch.arange(int(plens.sum())) - torch.repeat_interleave(torch.cumsum(plens, 0) - plens, plens)
    predictor = torch.where(
        t == 0, torch.repeat_interleave(prompt_last, plens), torch.repeat_interleave(resp_row, plens) + t - 1
    )
    return padded_layout(
        tokens, positions, segments, parents, pad_to_multiple, pad_token_id, response_ids.device,
        predictor_index=predictor, target_ids=targets, output_index=outputs, num_groups=len(groups),
        naive_tokens=sum(len(p) + length for p, length in zip(prompt_token_ids, lengths)),
    )


def padded_layout(
    tokens: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor, parents: torch.Tensor, pad_to_multiple: int,
    pad_token_id: int, device: torch.device, **fields,
) -> PackedLayout:
    """A :class:`PackedLayout` on ``device`` from its packed row, padded to a multiple of ``pad_to_multiple`` with
    ``pad_token_id`` tokens at position 0 in the padding segment; ``fields``: the layout's other fields (tensors
    are moved to ``device``)."""
    pad = -tokens.numel() % pad_to_multiple
    if pad:
        tokens = torch.cat([tokens, torch.full((pad,), pad_token_id, dtype=torch.long)])
        positions = torch.cat([positions, torch.zeros(pad, dtype=torch.long)])
        segments = torch.cat([segments, torch.full((pad,), PAD_SEGMENT, dtype=torch.int32)])
        parents = torch.cat([parents, torch.full((pad,), PROMPT_PARENT, dtype=torch.int32)])
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    return PackedLayout(input_ids=tokens.to(device), position_ids=positions.to(device), segment_ids=segments.to(device),
                        parent_ids=parents.to(device), **moved)
