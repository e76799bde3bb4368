"""The learning-rate schedule decays over the run's real length, whatever bounds it."""

from __future__ import annotations

import math

import pytest

from arctic_rl.cli import main
from arctic_rl.modules.lr_schedule import lr_factor
from tests.resume.conftest import run_config
from tests.resume.recorder import read_steps
from tests.helpers import write_config


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_factor_is_transformers_schedule(schedule):
    """The reference: transformers' ``get_scheduler`` (what TRL's GRPOTrainer steps), step by step."""
    import torch
    from transformers import get_scheduler

    name = {"constant": "constant_with_warmup"}.get(schedule, schedule)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    reference = get_scheduler(name, optimizer, num_warmup_steps=3, num_training_steps=11)
    expected = []
    for _ in range(12):  # steps 0..11; past the end transformers' cosine rises again, ours stays at 0
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert [lr_factor(s, 3, 11, schedule) for s in range(12)] == pytest.approx(expected, abs=1e-12)
    assert expected[0] == 0.0  # the first update only fills AdamW's moments, as in TRL


def test_lr_factor_warms_up_then_decays_to_zero():
    assert [lr_factor(s, 2, 6, "linear") for s in range(7)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(4, 0, 8, "cosine") == pytest.approx(0.5) and lr_factor(9, 0, 8, "cosine") == 0.0
    assert lr_factor(100, 0, 1, "constant") == 1.0


@pytest.mark.slow
def test_an_epoch_bounded_run_decays_over_its_epochs(toy_task, tmp_path):
    # 64 prompts / 16 a batch = 4 rollout batches x 2 mini-batches = 8 optimizer steps in the one epoch
    config = run_config(toy_task, tmp_path)
    config["model"]["init_args"]["optim"].update(lr_schedule="linear", warmup_steps=0, mini_batches=2)
    main(["fit", "--config", str(write_config(config, tmp_path / "c.yaml")), "--trainer.max_steps", "-1", "--trainer.max_epochs", "1"])
    steps = read_steps(tmp_path / "steps.jsonl")
    assert sorted(steps) == [1, 3, 5, 7]  # recorded after each rollout batch's 2 optimizer steps
    assert [steps[s]["lr"] / 0.003 for s in (1, 3, 5, 7)] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_a_decaying_schedule_on_a_run_bounded_only_by_time_is_refused_at_start(toy_task, tmp_path, capsys):
    config = run_config(toy_task, tmp_path)
    config["model"]["init_args"]["optim"]["lr_schedule"] = "cosine"
    args = ["fit", "--config", str(write_config(config, tmp_path / "c.yaml")), "--trainer.max_steps", "-1", "--trainer.max_time", "00:00:00:20"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2  # a config mistake: one line (a ConfigError)
    assert "error: model.optim.lr_schedule='cosine' decays over the run's length, but this run is bounded only by time" in capsys.readouterr().err
    assert not (tmp_path / "steps.jsonl").exists()  # refused before the first step


def test_cosine_floor_and_cycles_are_verls():
    # warmup 2, then progress 0, 1/4, 1/2, 3/4, 1 over steps 2..6: 0.2 + 0.8 (1 + cos(pi p)) / 2
    got = [lr_factor(s, 2, 6, "cosine", min_lr_ratio=0.2) for s in range(8)]
    assert got == pytest.approx([0.0, 0.5, 1.0, 0.2 + 0.4 * (1 + math.sqrt(0.5)), 0.6, 0.2 + 0.4 * (1 - math.sqrt(0.5)), 0.2, 0.2],
                                abs=1e-12)
    # one whole wave: down to the floor at mid-run, back to 1 at the end
    assert [lr_factor(s, 0, 4, "cosine", num_cycles=1.0) for s in range(5)] == pytest.approx([1.0, 0.5, 0.0, 0.5, 1.0], abs=1e-12)
