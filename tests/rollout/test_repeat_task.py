"""The repeat-the-digit task (``arctic_rl/tasks/repeat_toy.py``): heavy-tailed counts, a reward that only the policy's
own stopping can make whole, and rows the toy tokenizer reads without unknown words."""

from __future__ import annotations

import collections

import pytest

from arctic_rl.tasks.repeat_toy import MAX_COUNT, make_rows, repeat_score, repeat_tokenizer


@pytest.mark.parametrize("completion,count,expected", [
    ("7 7 7", 3, 1.0),              # the digit N times, then the end
    ("7 7 7 7 7 7", 3, 0.5),        # N more words past N: half the reward
    ("7 7 7 7", 3, 1.0 - 0.5 / 3),  # one word past N
    ("7 1 7", 3, 2 / 3),
    ("1 2", 3, 0.0),                # no digit: nothing, however short
    ("", 1, 0.0),
])
def test_the_reward_is_whole_only_for_the_digit_n_times_then_the_end(completion, count, expected):
    assert repeat_score(completion, "7", count) == pytest.approx(expected)


@pytest.mark.parametrize("completion,count,expected", [
    ("7 7 7", 3, 1.0),
    ("7 7 7 7", 3, 1.0 - 0.5 * (0.5 / 3 + 0.5 / 17)),  # one word past N: a third of the count, 1/17 of the room
    ("7 7 7 7 7 7", 3, 1.0 - 0.5 * (0.5 + 0.5 * 3 / 17)),
    (" ".join(["7"] * 20), 3, 0.5),                       # to the limit: the whole penalty
    (" ".join(["7"] * 12), 3, 1.0 - 0.5 * (0.5 + 0.5 * 9 / 17)),  # stopping before the limit scores more
    ("1 2", 3, 0.0),
])
def test_a_graded_stop_rewards_stopping_anywhere_before_the_limit(completion, count, expected):
    assert repeat_score(completion, "7", count, max_words=20) == pytest.approx(expected)


def test_the_tokenizer_holds_the_count_words_up_to_max_count():
    assert len(repeat_tokenizer()) - len(repeat_tokenizer(12)) == MAX_COUNT - 12
    rows = make_rows(500, seed=3, max_count=12)
    assert max(r["count"] for r in rows) == 12
    tokenizer = repeat_tokenizer(12)
    assert all(tokenizer.unk_token_id not in tokenizer(r["prompt"])["input_ids"] for r in rows)


def test_counts_are_heavy_tailed_and_rows_tokenize_without_unknown_words():
    rows = make_rows(2000, seed=0)
    counts = collections.Counter(r["count"] for r in rows)
    assert 0.4 < counts[1] / len(rows) < 0.6  # about half are 1
    assert sum(c for n, c in counts.items() if n >= 16) / len(rows) > 0.02  # and a tail reaches far
    assert max(counts) == MAX_COUNT and min(counts) == 1
    tokenizer = repeat_tokenizer()
    for row in rows[:200]:
        ids = tokenizer(row["prompt"])["input_ids"]
        assert tokenizer.unk_token_id not in ids and f"n{row['count']}" in row["prompt"].split()
