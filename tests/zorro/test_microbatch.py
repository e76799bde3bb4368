"""Token-budget micro-batch plans, checked by hand."""

import pytest

from arctic_rl.zorro.microbatch import Unit, first_fit_decreasing, plan_micro_batches, split_group


def test_split_group_repeats_the_prompt_per_sub_group():
    # prompt 4 tokens, responses 3,3,3,3, budget 11: [4+3+3] [4+3+3]
    units = split_group(4, [0, 1, 2, 3], [3, 3, 3, 3], 11)
    assert units == [Unit((0, 1), 10), Unit((2, 3), 10)]


def test_split_group_rejects_a_sample_over_budget():
    with pytest.raises(ValueError, match="sample 1"):
        split_group(8, [0, 1], [2, 5], 12)


def test_whole_groups_stay_together_and_fit_the_budget():
    prompts = [[1] * 4] * 2 + [[2] * 6] * 2 + [[3] * 2]
    lengths = [2, 2, 1, 1, 5]
    # groups: A=4+2+2=8 (samples 0,1), B=6+1+1=8 (2,3), C=2+5=7 (4); budget 16 -> [A,B] [C]
    assert plan_micro_batches(prompts, lengths, 16) == [[[0, 1, 2, 3], [4]]]


def test_ranks_are_balanced_and_get_equal_micro_batch_counts():
    prompts = [[1] * 4] * 2 + [[2] * 6] * 2 + [[3] * 2]
    lengths = [2, 2, 1, 1, 5]
    plan = plan_micro_batches(prompts, lengths, 16, num_ranks=2)
    # LPT: A(8) -> rank 0, B(8) -> rank 1, C(7) -> rank 0 (tie -> lowest rank); rank 0 packs A+C in one bin
    assert plan == [[[0, 1, 4]], [[2, 3]]]
    plan = plan_micro_batches(prompts, lengths, 9, num_ranks=2)
    assert plan == [[[0, 1], [4]], [[2, 3], []]]  # rank 1 padded with an empty micro-batch


def test_interleaved_shared_prompts_are_grouped():
    assert plan_micro_batches([[1], [2], [1], [2]], [1, 1, 1, 1], 3) == [[[0, 2], [1, 3]]]


def test_first_fit_decreasing():
    units = [Unit((0,), 5), Unit((1,), 4), Unit((2,), 3), Unit((3,), 2)]
    assert first_fit_decreasing(units, 7) == [[0, 3], [1, 2]]
