"""The built-in configs (``arctic-rl fit --config quickstart``, package data in ``arctic_rl/builtin/``) agree
with the repository's: the same settings, the same toy task files, and the same run directory when run
from the repository root (the wheel stage, ``scripts/ci/wheel.sh``, runs the built-in one from a wheel)."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest
import yaml

from arctic_rl.config_paths import BUILTIN_DIR, builtin_config_args, builtin_configs, resolve_config_args, resolve_paths

REPO = Path(__file__).resolve().parents[1]
DATA_KEYS = ("tokenizer", "train_path")


def resolved(path: Path, output_base: Path | None = None) -> dict:
    return resolve_paths(yaml.safe_load(path.read_text()), path.parent, output_base=output_base)


def test_the_builtin_quickstart_is_the_repositorys_with_its_task_beside_it():
    assert builtin_configs() == ["quickstart"]
    repo = resolved(REPO / "configs" / "quickstart.yaml")
    builtin = resolved(BUILTIN_DIR / "quickstart.yaml", output_base=REPO)  # run from the repository root
    repo_args, builtin_args = repo["model"]["init_args"], builtin["model"]["init_args"]
    assert Path(repo_args.pop("tokenizer")) == REPO / "data" / "toy" / "tokenizer"
    assert Path(builtin_args.pop("tokenizer")) == BUILTIN_DIR / "toy" / "tokenizer"
    assert Path(repo["data"]["init_args"].pop("train_path")) == REPO / "data" / "toy" / "train.jsonl"
    assert Path(builtin["data"]["init_args"].pop("train_path")) == BUILTIN_DIR / "toy" / "train.jsonl"
    assert builtin == repo  # everything else, run directories included


def test_the_builtin_toy_task_files_equal_the_repositorys():
    ours, theirs = BUILTIN_DIR / "toy", REPO / "data" / "toy"
    names = sorted(str(p.relative_to(theirs)) for p in theirs.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(ours)) for p in ours.rglob("*") if p.is_file())
    _, mismatch, errors = filecmp.cmpfiles(theirs, ours, names, shallow=False)
    assert mismatch == errors == []


def test_config_by_name_writes_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = builtin_config_args(["fit", "--config", "quickstart", "--trainer.max_steps", "3"])
    assert argv[2] == str(BUILTIN_DIR / "quickstart.yaml")
    config = yaml.safe_load(resolve_config_args(argv)[2])
    assert config["trainer"]["default_root_dir"] == str(tmp_path / "runs" / "quickstart")
    assert config["trainer"]["callbacks"][1]["init_args"]["dirpath"] == str(tmp_path / "runs" / "quickstart" / "checkpoints")
    assert os.path.isfile(Path(config["data"]["init_args"]["train_path"]))


def test_a_file_of_that_name_or_a_path_wins_over_a_builtin(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text("seed_everything: 1\n")
    assert builtin_config_args(["fit", "--config", "quickstart"]) == ["fit", "--config", "quickstart"]
    assert builtin_config_args(["fit", "--config=configs/quickstart.yaml"]) == ["fit", "--config=configs/quickstart.yaml"]
    assert builtin_config_args(["fit", "--config", "nonesuch"]) == ["fit", "--config", "nonesuch"]


def test_the_cli_takes_a_builtin_config_by_name(tmp_path, monkeypatch, capsys):
    from arctic_rl.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", "quickstart", "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["init_args"]["tokenizer"] == str(BUILTIN_DIR / "toy" / "tokenizer")
    assert printed["trainer"]["default_root_dir"] == str(tmp_path / "runs" / "quickstart")
