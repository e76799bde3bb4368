"""verl's padded batch as a ``TrainBatch`` (``integrations/verl_mapping.py``: pure torch, no verl import):
multi-turn responses whose tool tokens are 0 in ``response_mask`` keep those tokens as inputs."""

import pytest
import torch

from arctic_rl.integrations.verl_mapping import train_batch_from_verl


def verl_batch(response_mask: torch.Tensor) -> dict:
    """Two sequences: prompts [1 2] / [3] left-padded to 2; responses of 4 and 3 tokens right-padded to 5."""
    prompts = torch.tensor([[1, 2], [0, 3]])
    responses = torch.tensor([[4, 5, 6, 7, 0], [8, 9, 10, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 0, 0]])
    return {"prompts": prompts, "responses": responses, "attention_mask": attention, "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], 1)}


def test_tool_tokens_stay_inputs_with_zero_mask():
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 1, 0, 0]])  # sequence 0: tokens 5 and 6 came from a tool
    batch = train_batch_from_verl(verl_batch(mask), with_loss_inputs=False)
    assert batch.prompt_token_ids == [[1, 2], [3]]
    assert batch.response_ids.tolist() == [[4, 5, 6, 7, 0], [8, 9, 10, 0, 0]]
    assert torch.equal(batch.response_mask, mask.float())
    rollout = batch.to_rollout_batch(pad_token_id=99)
    assert rollout.response_ids.tolist() == [[4, 5, 6, 7, 99], [8, 9, 10, 99, 99]]  # the tool tokens are kept
    assert rollout.observation_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]
    assert rollout.sequence_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]


def test_mask_past_the_response_is_refused():
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # sequence 0's response has 4 tokens, not 5
    with pytest.raises(ValueError, match="sample 0: response_mask marks tokens past the response's end"):
        train_batch_from_verl(verl_batch(mask), with_loss_inputs=False)
