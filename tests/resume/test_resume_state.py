"""Resuming from the ``last.ckpt`` written at the end of a run continues the same epoch's data."""

from __future__ import annotations

import pytest

from tests.resume.conftest import STEPS, fit, run_config
from tests.resume.recorder import read_steps

pytestmark = pytest.mark.slow


def test_resume_from_the_end_of_run_last_ckpt_sees_the_same_prompts_as_an_uninterrupted_run(toy_task, tmp_path, reference_run, short_run):
    # the end-of-run save is written after Lightning counted epoch 0 as processed
    fit(run_config(toy_task, tmp_path), tmp_path / "c.yaml", "--ckpt_path", str(short_run / "checkpoints" / "last.ckpt"))
    reference = read_steps(reference_run)
    steps = {**read_steps(short_run / "steps.jsonl"), **read_steps(tmp_path / "steps.jsonl")}
    assert sorted(read_steps(tmp_path / "steps.jsonl")) == [3, 4, 5]
    for step in range(STEPS):
        assert steps[step]["prompts"] == reference[step]["prompts"], f"prompts differ at step {step}"
        assert steps[step]["epoch"] == reference[step]["epoch"], f"epoch differs at step {step}"
    assert [reference[s]["epoch"] for s in range(STEPS)] == [0, 0, 0, 0, 1, 1]
