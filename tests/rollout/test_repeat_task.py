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
