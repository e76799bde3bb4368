"""``RolloutBatch.concat``: what cross-rank balancing gathers (pure tensors, no engine)."""

import pytest
import torch

from arctic_rl.rollout.batch import RolloutBatch


def batch(prompts, lengths, width, first_reward, with_ref=False):
    n = len(prompts)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    return RolloutBatch(
        prompt_token_ids=prompts,
        response_ids=(torch.arange(n * width).view(n, width) + 1) * mask.long(),
        response_mask=mask,
        sampler_logprobs=-mask,
        rewards=torch.arange(first_reward, first_reward + n, dtype=torch.float32),
        advantages=torch.zeros(n),
        group_size=2,
        ref_logprobs=-2 * mask if with_ref else None,
        prompts=[f"p{i}" for i in range(n)],
        completions=[f"c{first_reward + i}" for i in range(n)],
    )


def test_concat_pads_to_the_longest_response_and_keeps_order():
    a = batch([[1, 2], [1, 2]], [1, 2], width=2, first_reward=0)
    b = batch([[3], [3], [4], [4]], [3, 1, 0, 2], width=3, first_reward=10)
    both = RolloutBatch.concat([a, b])
    assert both.num_sequences == 6 and both.response_ids.shape == (6, 3)
    assert both.prompt_token_ids == [[1, 2], [1, 2], [3], [3], [4], [4]]
    assert both.rewards.tolist() == [0, 1, 10, 11, 12, 13]
    assert both.response_mask.sum(-1).tolist() == [1, 2, 3, 1, 0, 2]
    assert both.response_ids[:2, 2].tolist() == [0, 0]  # padding sits under a zero mask
    torch.testing.assert_close(both.response_ids[:2, :2], a.response_ids)
    assert both.completions == ["c0", "c1", "c10", "c11", "c12", "c13"] and both.ref_logprobs is None
    assert RolloutBatch.concat([both.take([0, 3]), both.take([5])]).rewards.tolist() == [0, 11, 13]


def test_concat_rejects_mixed_optional_fields_and_group_sizes():
    a, b = batch([[1]], [1], 1, 0, with_ref=True), batch([[2]], [1], 1, 1)
    with pytest.raises(ValueError, match="only some have ref_logprobs"):
        RolloutBatch.concat([a, b])
    b.group_size = 4
    with pytest.raises(ValueError, match="group sizes \\[2, 4\\]"):
        RolloutBatch.concat([batch([[1]], [1], 1, 0), b])
