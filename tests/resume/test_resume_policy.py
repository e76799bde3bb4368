"""``--ckpt_path`` with a changed config: the config is used and the change announced, or refused."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import yaml

from tests.resume.conftest import fit, run_config
from tests.resume.recorder import read_steps


@pytest.mark.slow
def test_a_changed_learning_rate_is_applied_announced_and_saved(toy_task, tmp_path, short_run, capsys):
    ckpt = short_run / "checkpoints" / "last.ckpt"
    fit(run_config(toy_task, tmp_path), tmp_path / "c.yaml", "--ckpt_path", str(ckpt),
        "--model.init_args.optim.learning_rate", "0.001", "--trainer.max_steps", "4")
    err = capsys.readouterr().err
    assert ("arctic-rl: WARNING: resuming with a changed hyperparameter (applied): model.init_args.optim.learning_rate:"
            " 0.003 in the checkpoint, 0.001 in this run's config") in err
    steps = read_steps(tmp_path / "steps.jsonl")
    assert sorted(steps) == [3] and steps[3]["lr"] == pytest.approx(0.0008)  # 4 steps done: warm-up (5 steps) factor 4 / 5 for the next
    saved = yaml.safe_load(next((tmp_path / "logs").glob("version_*/config.yaml")).read_text())
    assert saved["model"]["init_args"]["optim"]["learning_rate"] == 0.001


@pytest.mark.parametrize("option,value,message", [
    ("--model.init_args.sampling.group_size", "4", r"model.init_args.sampling.group_size: 2 in the checkpoint, 4 in this run's config"),
    ("--model.init_args.regularizers.kl_coef", "0.1", r"model.init_args.regularizers.kl_coef: 0.0 in the checkpoint, 0.1 in this run's config"),
    ("--data.init_args.batch_size", "8", r"data.batch_size: 16 in the checkpoint, 8 now"),
])
@pytest.mark.slow
def test_a_change_that_breaks_resume_is_refused_before_training(toy_task, tmp_path, short_run, option, value, message, capsys):
    ckpt = tmp_path / "last.ckpt"
    shutil.copy(short_run / "checkpoints" / "last.ckpt", ckpt)
    with pytest.raises(SystemExit) as stopped:  # a ConfigError: one line on stderr, exit status 2
        fit(run_config(toy_task, tmp_path), tmp_path / "c.yaml", "--ckpt_path", str(ckpt), option, value)
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "steps.jsonl").exists()


def test_compare_sorts_each_change_into_refused_or_applied():
    from arctic_rl.resume_policy import compare

    saved = {"group_size": 8, "learning_rate": 3e-3, "kl_coef": 0.1, "temperature": 1.0, "dtype": "float32"}
    refused, applied = compare(saved, {**saved, "group_size": 4, "learning_rate": 1e-3, "kl_coef": 0.2, "dtype": "bfloat16"})
    assert refused == ["model.init_args.dtype: 'float32' in the checkpoint, 'bfloat16' in this run's config",
                       "model.init_args.sampling.group_size: 8 in the checkpoint, 4 in this run's config"]
    assert applied == ["model.init_args.optim.learning_rate: 0.003 in the checkpoint, 0.001 in this run's config",
                       "model.init_args.regularizers.kl_coef: 0.1 in the checkpoint, 0.2 in this run's config"]
    assert compare(saved, {**saved, "kl_coef": 0.0})[0] == ["model.init_args.regularizers.kl_coef: 0.1 in the checkpoint, 0.0 in this run's config"]
    # a checkpoint of the last release keeps the options flat; this run's config has them in sections
    nested = {"sampling": {"group_size": 4, "temperature": 1.0}, "optim": {"learning_rate": 1e-3},
              "regularizers": {"kl_coef": 0.1}, "dtype": "float32"}
    assert compare(saved, nested) == (["model.init_args.sampling.group_size: 8 in the checkpoint, 4 in this run's config"],
                                      ["model.init_args.optim.learning_rate: 0.003 in the checkpoint, 0.001 in this run's config"])


@pytest.mark.slow
def test_resuming_on_other_data_of_the_same_length_is_named(toy_task, tmp_path, short_run, capsys):
    """The checkpoint holds the data's fingerprint: other prompts (as many) warn, or with
    ``data.changed_data_on_resume: error`` stop before training in one line."""
    import json

    from arctic_rl.data.prompts import data_fingerprint, load_rows

    ckpt = tmp_path / "last.ckpt"
    shutil.copy(short_run / "checkpoints" / "last.ckpt", ckpt)
    rows = load_rows(toy_task / "train.jsonl")
    saved = torch.load(ckpt, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert saved["fingerprint"] == data_fingerprint(rows)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({**row, "answer": "0"}) + "\n" for row in rows))  # as many rows, other answers
    config = run_config(toy_task, tmp_path)
    config["data"]["init_args"].update(train_path=str(other), changed_data_on_resume="error")
    with pytest.raises(SystemExit) as stopped:
        fit(config, tmp_path / "c.yaml", "--ckpt_path", str(ckpt))
    assert stopped.value.code == 2
    assert re.search(rf"error: the training data differs from the checkpoint's \(fingerprint \w{{12}} now, {saved['fingerprint'][:12]}"
                     r" in the checkpoint\): the run resumes at the same position in other prompts; resume with the"
                     r" checkpoint's data, or set data.changed_data_on_resume: warn", capsys.readouterr().err)
    assert not (tmp_path / "steps.jsonl").exists()
