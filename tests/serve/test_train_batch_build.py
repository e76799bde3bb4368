"""``TrainBatch.build`` from ragged rows: hand-checked padding of every field, rows given as lists or tensors alike,
and the refusals of a bad loss mask naming the row."""

from __future__ import annotations

import pytest
import torch

from arctic_rl.serve.batch import TrainBatch


def test_ragged_rows_are_right_padded_with_zeros_in_every_field():
    batch = TrainBatch.build([[1, 2], [3]], [[5, 6, 7], [8]], [[0.5, 1.0, 1.5], [2.0]], loss_masks=[[1, 0, 1], [1]],
                             sampler_logprobs=[[-0.1, -0.2, -0.3], [-0.4]], old_logprobs=torch.full((2, 3), -1.0))
    assert batch.prompt_token_ids == [[1, 2], [3]]
    assert batch.response_ids.dtype == torch.long and batch.response_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert batch.advantages.tolist() == [[0.5, 1.0, 1.5], [2.0, 0.0, 0.0]]
    assert torch.equal(batch.sampler_logprobs, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))  # float32 rounding
    assert batch.old_logprobs.tolist() == [[-1.0] * 3] * 2


def test_rows_as_tensors_build_the_same_batch_as_lists():
    lists = TrainBatch.build([[1], [1]], [[5, 6], [7]], [1.0, -1.0], sampler_logprobs=[[-0.1, -0.25], [-1 / 3]])
    tensors = TrainBatch.build([[1], [1]], [torch.tensor([5, 6]), torch.tensor([7])], torch.tensor([1.0, -1.0]),
                               sampler_logprobs=[torch.tensor([-0.1, -0.25], dtype=torch.float64), torch.tensor([-1 / 3])])
    for name in ("response_ids", "response_mask", "advantages", "sampler_logprobs"):
        assert torch.equal(getattr(lists, name), getattr(tensors, name)), name


def test_no_rows_make_an_empty_batch():
    batch = TrainBatch.build([], [], [])
    assert batch.response_ids.shape == (0, 0) and batch.response_mask.shape == (0, 0)


@pytest.mark.parametrize("masks, row", [([[1, 1], [1, 2]], 1), ([[1], [1]], 0), ([[1, 0.5], [1]], 0)])
def test_a_bad_loss_mask_is_refused_naming_its_row(masks, row):
    with pytest.raises(ValueError, match=rf"loss_masks\[{row}\] must be 2 values of 0 or 1"):
        TrainBatch.build([[1], [1]], [[5, 6], [7, 8]], [1.0, 1.0], loss_masks=masks)
