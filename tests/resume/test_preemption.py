"""SIGTERM (preemption, ``docker stop``, Slurm): the step in flight finishes, a resumable checkpoint
is written, the summary printed, the engines shut down, and the process exits 143 (128 + SIGTERM)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.resume.conftest import STEPS, fit, run_config
from tests.resume.recorder import read_steps
from tests.helpers import run_cli

pytestmark = pytest.mark.slow


def test_sigterm_saves_a_checkpoint_that_resumes_like_an_uninterrupted_run(toy_task, tmp_path, reference_run):
    sigterm = {"class_path": "tests.resume.recorder.SigtermAtStep", "init_args": {"step": 2}}  # a real SIGTERM
    temp = tmp_path / "tmp"
    temp.mkdir()
    done = run_cli(run_config(toy_task, tmp_path, sigterm), tmp_path / "c.yaml", TMPDIR=str(temp))
    assert done.returncode == 143, done.stderr[-3000:]
    assert sorted(read_steps(tmp_path / "steps.jsonl")) == [0, 1, 2]  # step 2 was under way: it finished
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 3
    summary = [line for line in done.stdout.splitlines() if line.startswith("arctic-rl: ")]
    assert len(summary) == 2 and summary[0].startswith("arctic-rl: 3 steps in ") and f"checkpoint: {last}" in summary[0]
    assert summary[1] == f"arctic-rl: stopped by SIGTERM after step 3; resume with --ckpt_path {last} (exit code 143)"
    assert not [e for e in os.listdir(temp) if e.startswith("arctic-rl-engine-")]  # engine shut down, weight copy removed

    fit(run_config(toy_task, tmp_path), tmp_path / "c.yaml", "--ckpt_path", str(last))
    reference, steps = read_steps(reference_run), read_steps(tmp_path / "steps.jsonl")
    assert sorted(steps) == list(range(STEPS))
    for step in range(STEPS):
        assert steps[step]["prompts"] == reference[step]["prompts"], f"prompts differ at step {step}"
        assert steps[step]["epoch"] == reference[step]["epoch"], f"epoch differs at step {step}"
        assert steps[step]["reward"] == pytest.approx(reference[step]["reward"], abs=1e-6), f"reward differs at step {step}"

