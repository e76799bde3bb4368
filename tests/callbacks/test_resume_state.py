"""Resuming from the ``last.ckpt`` written at the end of a run continues the same epoch's data."""

from __future__ import annotations

import pytest

from tests.callbacks.conftest import STEPS, fit, run_config
from tests.callbacks.recorder import read_steps

pytestmark = pytest.mark.slow


def test_resume_from_the_end_of_run_last_ckpt_sees_the_same_prompts_as_an_uninterrupted_run(toy_task, tmp_path, reference_run):
    # 3 steps end mid-epoch 0 (4 batches an epoch) and 3 is not a multiple of every_n_train_steps: the
    # last.ckpt is the end-of-run save, written after Lightning counted epoch 0 as processed
    config = run_config(toy_task, tmp_path)
    fit(config, tmp_path / "c.yaml", "--trainer.max_steps", "3")
    fit(config, tmp_path / "c.yaml", "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"))
    reference, steps = read_steps(reference_run), read_steps(tmp_path / "steps.jsonl")
    assert sorted(steps) == list(range(STEPS))
    for step in range(STEPS):
        assert steps[step]["prompts"] == reference[step]["prompts"], f"prompts differ at step {step}"
        assert steps[step]["epoch"] == reference[step]["epoch"], f"epoch differs at step {step}"
    assert [reference[s]["epoch"] for s in range(STEPS)] == [0, 0, 0, 0, 1, 1]
