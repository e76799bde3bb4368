"""Evidence that multi-turn GRPO learns to use a tool: the secret-digit toy (``tasks/tool_toy.py``), whose answer
only the tool knows (no call: reward 0; a guess: 1 in 10), trained from a random tiny Qwen3 on CPU with the
transformers engine (``configs/multi_turn_toy.yaml``, 120 steps, about 40 s on 2 idle cores).

What it shows (docs/multi_turn.md): the policy learns to call the tool (turns per episode from about 1.4 to 2) and
its success rate (``accuracy``: the first word after the last observation is the digit) rises from about 0.005 to
about 0.09: the rate of a policy that calls the tool and answers with some digit. Copying the tool's digit (success
towards 1) takes far longer: seed 0 reaches 0.16 over steps 151-200.

Measured with one OpenMP thread per process, as the suite runs (root ``conftest.py``); the thread count changes the
kernels' summation order, so another count follows another (equally valid) trajectory: with two threads, seed 0
reached 0.097 and 1.79 turns over steps 151-200."""

from __future__ import annotations

import pytest

from arctic_rl.tasks.tool_toy import write_task
from tests.multi_turn_runs import train_and_record

pytestmark = pytest.mark.slow

STEPS = 120  # the learning rate is constant after 3 warm-up steps: these are a longer run's first steps


def test_success_rate_rises_when_the_answer_is_only_in_the_tool(tmp_path):
    record = train_and_record(write_task(tmp_path / "task"), tmp_path, "configs/multi_turn_toy.yaml", STEPS)
    assert len(record.accuracy) == STEPS
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    assert mean(record.accuracy[:10]) < 0.03, record.accuracy[:10]  # a random policy: seldom calls, seldom a digit after
    assert mean(record.accuracy[-50:]) > 0.06, record.accuracy  # 0.092 measured (seed 0, steps 71-120): 20x the start
    # it learned to call the tool: seed 0 goes from 1.38 turns (steps 1-10) to 1.98 (steps 71-120); measured 2026-12-04
    assert mean(record.turns[:10]) < 1.6 and mean(record.turns[-50:]) > 1.7, record.turns
