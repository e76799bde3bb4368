"""Bad config values and inputs: ``arctic-rl fit`` prints one line naming the field, file or line and
exits with status 2, before any model or engine starts."""

import json
import os
import re
import subprocess
import sys

import pytest

from arctic_rl.cli import main
from tests.helpers import REPO, quickstart_config, write_config


def _jsonl_with_a_bare_number(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1", "answer": "1"}\n42\n')
    return {"data.init_args.train_path": str(path)}, [], rf"{path}:2: expected a JSON object per line .*got int 42"


def _json_array_with_a_number(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps([{"prompt": "1", "answer": "1"}, 42]))
    return {"data.init_args.train_path": str(path)}, [], rf"{path}: item 1 of the array is int 42, expected an object"


def _garbage_checkpoint(tmp_path):
    path = tmp_path / "garbage.ckpt"
    path.write_bytes(bytes(range(256)) * 4)
    return {}, ["--ckpt_path", str(path)], rf"--ckpt_path {path}: {path} is corrupt \(1024 bytes, not a complete torch.save"


def _empty_checkpoint(tmp_path):
    path = tmp_path / "last.ckpt"
    path.write_bytes(b"")
    return {}, ["--ckpt_path", str(path)], rf"{path} is corrupt \(0 bytes"


def _missing_checkpoint(tmp_path):
    return {}, ["--ckpt_path", str(tmp_path / "nope.ckpt")], rf"--ckpt_path {tmp_path}/nope.ckpt does not exist"


def _missing_tokenizer(tmp_path):
    path = tmp_path / "no/such/tokenizer"
    return {"model.init_args.tokenizer": str(path)}, [], rf"model.tokenizer: path '{path}' does not exist"


CASES = {
    "group_size_1": lambda t: ({"model.init_args.group_size": 1}, [], r"model.group_size must be >= 2 .*got 1"),
    "max_response_length_0": lambda t: ({"model.init_args.max_response_length": 0}, [], r"model.max_response_length must be >= 1, got 0"),
    "temperature_0": lambda t: ({"model.init_args.temperature": 0.0}, [], r"model.temperature must be > 0, got 0.0"),
    "top_p_1.5": lambda t: ({"model.init_args.top_p": 1.5}, [], r"model.top_p must be in \(0, 1\], got 1.5"),
    "missing_model_path": lambda t: ({"model.init_args.model": "runs/no/such/model"}, [], r"model.model: path 'runs/no/such/model' does not exist"),
    "missing_tokenizer_path": _missing_tokenizer,
    "devices_2_without_arctic_strategy": lambda t: (
        {"trainer.devices": 2}, [],
        r"trainer.devices=2 x trainer.num_nodes=1 training processes need trainer.strategy: arctic_rl.strategies.ArcticStrategy",
    ),
    "ray_num_workers_two": lambda t: ({"ray": {"num_workers": "two"}}, [], r"ray.num_workers must be int, got 'two'"),
    "vllm_float64": lambda t: ({"model.init_args.dtype": "float64"}, [],  # the quickstart's engine is vllm
                               r"RolloutCallback.engine 'vllm' cannot run model.dtype 'float64' .*use engine: transformers"),
    "jsonl_bare_42": _jsonl_with_a_bare_number,
    "json_array_of_non_objects": _json_array_with_a_number,
    "corrupt_checkpoint": _garbage_checkpoint,
    "empty_checkpoint": _empty_checkpoint,
    "missing_checkpoint": _missing_checkpoint,
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_naming_it(case, tmp_path, toy_task, capsys):
    changes, args, message = CASES[case](tmp_path)
    config = write_config(quickstart_config(toy_task, tmp_path, **changes), tmp_path / "c.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), *args])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert not (tmp_path / "checkpoints").exists()  # nothing ran


def test_a_config_error_prints_no_traceback(tmp_path, toy_task):
    """Through a real ``python -m arctic_rl.cli`` process: the error line, and no traceback or config dump."""
    config = write_config(quickstart_config(toy_task, tmp_path, **{"model.init_args.temperature": 0.0}), tmp_path / "c.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(config)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "error: model.temperature must be > 0, got 0.0"
    assert "Traceback" not in proc.stderr and "init_args" not in proc.stderr
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr  # Lightning's "Seed set to 0" may precede it
