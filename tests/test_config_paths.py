"""Config-relative paths and task modules beside the config (arctic_rl/config_paths.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from arctic_rl.config_paths import config_dirs, resolve_config_args, resolve_paths
from tests.helpers import cli_env

BASE = Path("/cfg/dir")


@pytest.mark.parametrize("key,value,resolved", [
    ("train_path", "data/train.jsonl", "/cfg/dir/data/train.jsonl"),
    ("tokenizer", "../tok", "/cfg/tok"),
    ("dirpath", "/abs/ckpt", "/abs/ckpt"),
    ("save_dir", ".", "/cfg/dir"),
    ("model", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B"),  # a hub id, not a path key
    ("model", "./my_model", "/cfg/dir/my_model"),  # ./ marks a path under any key
    ("class_path", "my_task.MathGRPO", "my_task.MathGRPO"),
    ("train_path", "s3://bucket/x", "s3://bucket/x"),
    ("save_dir", "~/runs", "~/runs"),
    ("dirpath", 3, 3),
])
def test_resolve_paths(key, value, resolved):
    assert resolve_paths({"a": [{key: value}]}, BASE) == {"a": [{key: resolved}]}


def test_each_config_is_inlined_with_its_own_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.yaml").write_text("data: {init_args: {train_path: t.jsonl}}\n")
    (tmp_path / "sub/b.yaml").write_text("trainer: {default_root_dir: runs}\n")
    argv = ["fit", "--config", str(tmp_path / "a.yaml"), f"--config={tmp_path / 'sub/b.yaml'}", "--data.init_args.train_path", "x"]
    out = resolve_config_args(argv)
    assert yaml.safe_load(out[2]) == {"data": {"init_args": {"train_path": str(tmp_path / "t.jsonl")}}}
    assert yaml.safe_load(out[3].split("=", 1)[1]) == {"trainer": {"default_root_dir": str(tmp_path / "sub/runs")}}
    assert out[4:] == ["--data.init_args.train_path", "x"]  # command-line values stay relative to the cwd
    assert str(tmp_path) in sys.path and str(tmp_path / "sub") in sys.path
    assert config_dirs(argv) == [str(tmp_path), str(tmp_path / "sub")]
    sys.path.remove(str(tmp_path)), sys.path.remove(str(tmp_path / "sub"))


def test_a_config_runs_from_another_directory_with_its_task_module_beside_it(tmp_path, toy_task):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data/train.jsonl").write_text((toy_task / "train.jsonl").read_text())
    (project / "my_task.py").write_text(
        "from arctic_rl.tasks.toy import EchoDigitGRPO\n\nclass MyGRPO(EchoDigitGRPO):\n    pass\n"
    )
    config = {
        "model": {"class_path": "my_task.MyGRPO", "init_args": {"model": {"model_type": "qwen3"}, "tokenizer": str(toy_task / "tokenizer")}},
        "data": {"class_path": "arctic_rl.PromptDataModule", "init_args": {"train_path": "data/train.jsonl"}},
        "trainer": {"default_root_dir": "runs/x"},
    }
    (project / "run.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in cli_env().items()}
    proc = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(project / "run.yaml"), "--print_config"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["model"]["class_path"] == "my_task.MyGRPO"
    assert printed["data"]["init_args"]["train_path"] == str(project / "data/train.jsonl")
    assert printed["trainer"]["default_root_dir"] == str(project / "runs/x")


def test_ray_train_workers_put_the_config_directories_first_on_sys_path(tmp_path, monkeypatch):
    from arctic_rl.cluster import launch

    monkeypatch.setenv(launch.WORKER_ENV, "0")  # restored after the worker loop sets it
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    seen = []
    loop_config = {"cwd": str(tmp_path), "argv": ["fit"], "import_dirs": [str(tmp_path / "cfg")],
                   "run_cli": lambda argv: seen.append((argv, sys.path[0]))}
    launch._worker_loop(loop_config)
    assert seen == [(["fit"], str(tmp_path / "cfg"))]
