"""Evidence that the search agent learns to use its search tool: the search toy (``tasks/search_toy.py``), whose
code is only in each row's hidden corpus (no search: reward 0; a guess: 1 in 10), trained from a random tiny Qwen3 on
CPU with the transformers engine (``recipes/search_agent/toy.yaml``).

What it shows (recipes/search_agent/README.md has the measured runs): the policy learns to close the search call
(turns per episode towards 2) and to answer with the code the search returned: success (``accuracy``: the first
word after the observation is the code) rises from about 0.01 to 0.3-0.9 in 100 steps (0.28-0.83 on
seeds 0-4, 0.81-0.89 on seed 0, the test's), past the 0.1 of a policy that searches and guesses."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("bm25s") is None:  # not importorskip: importing bm25s directly would load numba
    pytest.skip("needs bm25s (the search extra)", allow_module_level=True)

from arctic_rl.tasks.search_toy import write_task  # noqa: E402
from tests.multi_turn_runs import train_and_record  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 100  # about 30 s of training on 2 idle cores (0.3 s a step); seed 0 passes from step ~60 (0.77 at 71-80)


def test_success_rises_when_the_answer_is_only_found_by_searching(tmp_path):
    record = train_and_record(write_task(tmp_path / "task"), tmp_path, "recipes/search_agent/toy.yaml", STEPS)
    assert len(record.accuracy) == STEPS
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    first, last = mean(record.accuracy[:10]), mean(record.accuracy[-10:])
    assert first < 0.05, record.accuracy[:10]  # a random policy seldom closes the call and names the code
    # measured (seeds 0-4, 2026-12-02): first 10 steps 0.007-0.016; steps 91-100 0.81 / 0.83 / 0.72 / 0.64 / 0.28
    # (seed 0 again on 2026-12-03: 0.013 -> 0.889)
    assert last >= 0.25 and last >= first + 0.2, record.accuracy  # past searching and guessing (0.1) on every seed
    assert mean(record.turns[-10:]) > 1.8, record.turns  # it searches
