"""Hand-checked layouts of ``pack_shared_prompts`` and the dedup statistics."""

import pytest
import torch

from arctic_rl.zorro.packing import PAD_SEGMENT, PROMPT_PARENT, dedup_stats, pack_shared_prompts, response_lengths

P, X = PROMPT_PARENT, PAD_SEGMENT


def test_docstring_example_layout():
    # samples: (prompt p, response a), (q, c), (p, b); p shared by samples 0 and 2, q alone
    prompts = [[10, 11, 12], [20, 21], [10, 11, 12]]
    responses = torch.tensor([[1, 2, 0], [5, 0, 0], [3, 4, 6]])
    layout = pack_shared_prompts(prompts, responses, [2, 1, 3])
    assert layout.input_ids.tolist() == [10, 11, 12, 1, 2, 3, 4, 6, 20, 21, 5]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]
    assert layout.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4]
    assert layout.parent_ids.tolist() == [P, P, P, 0, 0, 0, 0, 0, P, P, 3]
    # sample-major response tokens: a0 a1 | c0 | b0 b1 b2
    assert layout.target_ids.tolist() == [1, 2, 5, 3, 4, 6]
    # a0 <- prompt end (2), a1 <- a0 (3); c0 <- q end (9); b0 <- 2, b1 <- b0 (5), b2 <- b1 (6)
    assert layout.predictor_index.tolist() == [2, 3, 9, 2, 5, 6]
    assert layout.output_index.tolist() == [0, 1, 3, 6, 7, 8]  # flat [N=3, R=3]
    assert (layout.num_groups, layout.naive_tokens, layout.processed_tokens) == (2, 14, 11)


def test_docstring_example_prompts_first():
    prompts = [[10, 11, 12], [20, 21], [10, 11, 12]]
    responses = torch.tensor([[1, 2, 0], [5, 0, 0], [3, 4, 6]])
    layout = pack_shared_prompts(prompts, responses, [2, 1, 3], prompts_first=True)
    assert layout.input_ids.tolist() == [10, 11, 12, 20, 21, 1, 2, 3, 4, 6, 5]
    assert layout.position_ids.tolist() == [0, 1, 2, 0, 1, 3, 4, 3, 4, 5, 2]
    assert layout.segment_ids.tolist() == [0, 0, 0, 3, 3, 1, 1, 2, 2, 2, 4]
    assert layout.parent_ids.tolist() == [P, P, P, P, P, 0, 0, 0, 0, 0, 3]
    assert layout.target_ids.tolist() == [1, 2, 5, 3, 4, 6]
    # a0 <- p end (2), a1 <- a0 (5); c0 <- q end (4); b0 <- 2, b1 <- b0 (7), b2 <- b1 (8)
    assert layout.predictor_index.tolist() == [2, 5, 4, 2, 7, 8]
    assert layout.output_index.tolist() == [0, 1, 3, 6, 7, 8]


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="2 prompts and 1 lengths for 2 responses"):
        pack_shared_prompts([[1], [2]], torch.tensor([[1], [2]]), [1])


def test_padding_to_block_multiple():
    layout = pack_shared_prompts([[7, 8]], torch.tensor([[1, 2]]), [2], pad_to_multiple=4, pad_token_id=99)
    assert layout.input_ids.tolist() == [7, 8, 1, 2]
    layout = pack_shared_prompts([[7, 8, 9]], torch.tensor([[1, 2]]), [2], pad_to_multiple=4, pad_token_id=99)
    assert layout.input_ids.tolist() == [7, 8, 9, 1, 2, 99, 99, 99]
    assert layout.segment_ids.tolist()[-3:] == [X, X, X]
    assert layout.parent_ids.tolist()[-3:] == [P, P, P]
    assert layout.processed_tokens == 5 and layout.num_tokens == 8


def test_groups_without_response_tokens_are_skipped():
    prompts = [[1, 2], [3], [1, 2]]
    layout = pack_shared_prompts(prompts, torch.tensor([[5, 6], [7, 0], [0, 0]]), [2, 0, 0])
    assert layout.input_ids.tolist() == [1, 2, 5, 6]  # prompt [3] has nothing to predict; [1,2]'s 2nd sample is empty
    assert layout.segment_ids.tolist() == [0, 0, 1, 1]


def test_response_lengths_and_holes():
    assert response_lengths(torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])) == [2, 0, 3]
    with pytest.raises(ValueError, match="row 1"):
        response_lengths(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))


def test_dedup_stats_counts_each_prompt_once():
    prompts = [[1, 2, 3, 4]] * 3 + [[5, 6]]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.float32)
    stats = dedup_stats(prompts, mask)
    assert stats.naive_tokens == (4 + 2) + (4 + 1) + (4 + 3) + (2 + 3)
    assert stats.processed_tokens == (4 + 2 + 1 + 3) + (2 + 3)
    assert stats.ratio == pytest.approx(23 / 15)
    assert stats.as_metrics()["zorro/dedup_ratio"] == pytest.approx(23 / 15)


def test_empty_prompt_is_an_error():
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\]"):
        pack_shared_prompts([[1], []], torch.tensor([[1], [2]]), [1, 1])
