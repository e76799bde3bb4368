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
    "group_size_1": lambda t: ({"model.init_args.sampling.group_size": 1}, [], r"model.sampling.group_size must be >= 2 .*got 1"),
    "max_response_length_0": lambda t: ({"model.init_args.sampling.max_response_length": 0}, [], r"model.sampling.max_response_length must be >= 1, got 0"),
    "temperature_0": lambda t: ({"model.init_args.sampling.temperature": 0.0}, [], r"model.sampling.temperature must be > 0, got 0.0"),
    "top_p_1.5": lambda t: ({"model.init_args.sampling.top_p": 1.5}, [], r"model.sampling.top_p must be in \(0, 1\], got 1.5"),
    "missing_model_path": lambda t: ({"model.init_args.model": "runs/no/such/model"}, [], r"model.model: path 'runs/no/such/model' does not exist"),
    "missing_tokenizer_path": _missing_tokenizer,
    "devices_2_without_arctic_strategy": lambda t: (
        {"trainer.devices": 2}, [],
        r"trainer.devices=2 x trainer.num_nodes=1 training processes need trainer.strategy: arctic_rl.strategies.ArcticStrategy",
    ),
    "lora_with_zero3": lambda t: (  # preflight: before the process group, any model or engine
        {"model.init_args.lora": {"rank": 4},
         "trainer.strategy": {"class_path": "arctic_rl.strategies.ArcticStrategy", "init_args": {"stage": 3}}}, [],
        r"model.lora.rank=4 needs ZeRO stage 1 or 2 \(or no DeepSpeed\), but trainer.strategy \(ArcticStrategy\) runs ZeRO stage 3",
    ),
    "ray_num_workers_two": lambda t: ({"ray": {"num_workers": "two"}}, [], r"ray.num_workers must be int, got 'two'"),
    "flex_attention_on_cpu": lambda t: ({"model.init_args.compute.attention_backend": "flex"}, [],
                                        r"model.compute.attention_backend 'flex' needs a CUDA device .* but this run trains on cpu"),
    "ray_placement_lowercase": lambda t: ({"ray": {"placement_strategy": "spread"}}, [],
                                          r"ray.placement_strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, got 'spread'"),
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
    config = write_config(quickstart_config(toy_task, tmp_path, **{"model.init_args.sampling.temperature": 0.0}), tmp_path / "c.yaml")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "arctic_rl.cli", "fit", "--config", str(config)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "error: model.sampling.temperature must be > 0, got 0.0"
    assert "Traceback" not in proc.stderr and "init_args" not in proc.stderr
    assert len(proc.stderr.splitlines()) <= 2, proc.stderr  # Lightning's "Seed set to 0" may precede it


# ---------------------------------------------------------------- through the real CLI, many at once
# Each case is its own `arctic-rl fit` process (forked from one that imported the dependencies once:
# tests/cli_forks.py); they all stop in the constructors or in preflight / data setup, before any model
# or engine starts.


def _rollout_callback(config: dict, **init_args) -> dict:
    """``config`` with ``init_args`` added to its RolloutCallback."""
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("RolloutCallback"):
            callback["init_args"].update(init_args)
    return config


def _train_file(name: str, content: bytes):
    """A case whose data.train_path is a file of ``content``; the message pattern gets its path."""
    def case(d):
        path = d / name
        path.write_bytes(content)
        return {"data.init_args.train_path": str(path)}, str(path)
    return case


ASYNC_TASK = '''
from arctic_rl.tasks.toy import EchoDigitGRPO


class AsyncEchoGRPO(EchoDigitGRPO):
    async def reward(self, prompts, completions, answer, **columns):
        return [1.0 for _ in completions]
'''


def _async_reward(d):
    (d / "async_task.py").write_text(ASYNC_TASK)
    return {"model.class_path": "async_task.AsyncEchoGRPO"}, ""


def _root_is_a_file(d):
    (d / "root").write_text("not a directory")
    return {"trainer.default_root_dir": str(d / "root")}, str(d / "root")


CLI_CASES = {  # name: (changes to the quickstart or a function of the case's dir giving them, message pattern)
    "max_grad_norm_negative": ({"model.init_args.optim.max_grad_norm": -1.0}, r"model.optim.max_grad_norm must be a finite number in \[0.0, inf\], got -1.0$"),
    "kl_coef_negative": ({"model.init_args.regularizers.kl_coef": -0.5}, r"model.regularizers.kl_coef must be a finite number in \[0.0, inf\], got -0.5$"),
    "clip_low_1.5": ({"model.init_args.loss.clip_low": 1.5}, r"model.loss.clip_low must be a finite number in \[0.0, 1.0\), got 1.5$"),
    "clip_low_1": ({"model.init_args.loss.clip_low": 1.0}, r"model.loss.clip_low must be a finite number in \[0.0, 1.0\), got 1.0$"),
    "clip_low_negative": ({"model.init_args.loss.clip_low": -0.1}, r"model.loss.clip_low must be a finite number in \[0.0, 1.0\), got -0.1$"),
    "clip_high_nan": ({"model.init_args.loss.clip_high": float("nan")}, r"model.loss.clip_high must be a finite number in \[0.0, inf\], got nan$"),
    "warmup_steps_negative": ({"model.init_args.optim.warmup_steps": -5}, r"model.optim.warmup_steps must be an integer >= 0, got -5$"),
    "learning_rate_negative": ({"model.init_args.optim.learning_rate": -0.001}, r"model.optim.learning_rate must be a finite number in \[0.0, inf\], got -0.001$"),
    "learning_rate_nan": ({"model.init_args.optim.learning_rate": float("nan")}, r"model.optim.learning_rate must be a finite number in \[0.0, inf\], got nan$"),
    "dtype_float8": ({"model.init_args.dtype": "float8"}, r"model.dtype must be one of float32, bfloat16, float16, float64, got 'float8'$"),
    "context_over_max_position_embeddings": (
        {"model.init_args.sampling.max_response_length": 100},
        r"model.sampling.max_prompt_length \+ model.sampling.max_response_length = 32 \+ 100 = 132 exceeds the model's max_position_embeddings=128",
    ),
    "mini_batches_200": ({"model.init_args.optim.mini_batches": 200}, r"data.batch_size=16 prompts cannot be split into model.optim.mini_batches=200"),
    "micro_batch_size_and_tokens": (
        {"model.init_args.compute.micro_batch_size": 2, "model.init_args.compute.micro_batch_tokens": 100},
        r"set model.compute.micro_batch_size or model.compute.micro_batch_tokens, not both$",
    ),
    "loss_kwargs_unknown": ({"model.init_args.loss_kwargs": {"cispo_max_ration": 2.0}}, r"model.loss_kwargs: unknown keys \['cispo_max_ration'\]"),
    "max_staleness_negative": (lambda d: ({"__callback__": {"max_staleness": -1}}, ""), r"RolloutCallback.max_staleness must be an integer >= 0, got -1$"),
    "engine_kwargs_typo": (
        lambda d: ({"__callback__": {"engine": "vllm", "engine_kwargs": {"gpu_memory_utilisation": 0.3}}}, ""),
        r"RolloutCallback.engine_kwargs: the vllm engine takes no argument 'gpu_memory_utilisation'; did you mean 'gpu_memory_utilization'\?$",
    ),
    "chat_message_without_content": (
        _train_file("chat.jsonl", b'{"prompt": [{"role": "user", "content": "3"}], "answer": "3"}\n{"prompt": [{"role": "user"}], "answer": "4"}\n'),
        r"{path}: row 1: message 0 \(user\) has no 'content'",
    ),
    "jsonl_with_0xff": (
        _train_file("train.jsonl", b'{"prompt": "1", "answer": "1"}\n{"prompt": "2", "answer": "2"}\n{"prompt": "\xff", "answer": "3"}\n'),
        r"{path}:3: byte 0xff is not UTF-8",
    ),
    "missing_reward_column": (
        _train_file("no_answer.jsonl", b"".join(b'{"prompt": "%d"}\n' % i for i in range(32))),
        r"EchoDigitGRPO.reward takes the column\(s\) \['answer'\], which {path} lacks",
    ),
    "lr_schedule_cosine_without_a_length": (
        {"model.init_args.optim.lr_schedule": "cosine", "trainer.max_steps": -1},
        r"model.optim.lr_schedule='cosine' decays over the run's length, but this run is bounded by nothing",
    ),
    "async_reward": (_async_reward, r"AsyncEchoGRPO.reward is 'async def': async rewards are not supported"),
    "default_root_dir_is_a_file": (_root_is_a_file, r"trainer.default_root_dir {path}: {path} is a file, not a directory"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory, toy_task):
    """``{case: (finished arctic-rl process, message pattern, case dir)}`` for every ``CLI_CASES`` case."""
    from tests.helpers import run_cli_many

    commands, patterns, dirs = {}, {}, {}
    for name, (changes, pattern) in CLI_CASES.items():
        d = dirs[name] = tmp_path_factory.mktemp(name)
        path = ""
        if callable(changes):
            changes, path = changes(d)
        changes = dict(changes)
        callback = changes.pop("__callback__", None)
        config = quickstart_config(toy_task, d / "run", **{"trainer.max_steps": 1, **changes})  # short, should one start
        if callback:
            _rollout_callback(config, **callback)
        commands[name] = ["fit", "--config", str(write_config(config, d / "c.yaml"))]
        patterns[name] = pattern.replace("{path}", re.escape(path))
    results = run_cli_many(commands, tmp_path_factory.mktemp("cli_many"))
    return {name: (results[name], patterns[name], dirs[name]) for name in CLI_CASES}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_setting_or_data_is_one_line_with_exit_2(case, cli_results):
    proc, pattern, case_dir = cli_results[case]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: ") and re.search(pattern, last), last
    assert not (case_dir / "run" / "checkpoints").exists()  # nothing trained
