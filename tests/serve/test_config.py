"""``ArcticRLClientConfig.load``: sources, overrides, the token, one ``ConfigError`` naming every bad field,
the cross-field rules, and the generated config reference."""

import json
import re

import pytest
from pydantic import BaseModel, ValidationError

from arctic_rl.errors import ConfigError
from arctic_rl.serve.config import ArcticRLClientConfig, config_reference_markdown

TOKEN = "tok-9f8e7d"
TINY = {"model_type": "qwen3", "hidden_size": 16}


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("ARCTIC_RL_TOKEN", raising=False)


def test_defaults():
    cfg = ArcticRLClientConfig.load(model="Qwen/Qwen3-0.6B")
    assert (cfg.protocol, cfg.server_url, cfg.auth_token, cfg.dtype, cfg.seed) == ("local", None, None, "float32", 0)
    assert (cfg.training.zero_stage, cfg.training.learning_rate, cfg.training.precision) == (0, 1e-6, "32-true")
    assert (cfg.sampling.engine, cfg.sampling.num_engines, cfg.sampling.engine_kwargs) == ("auto", 1, {})
    assert (cfg.zorro.enabled, cfg.timeouts.call_s, cfg.server.host, cfg.server.port) == (True, 600.0, "127.0.0.1", 0)
    with pytest.raises(ValidationError):
        cfg.training.learning_rate = 1.0  # frozen: change a config through load(cfg, **overrides)


def test_sources_and_recursive_overrides(tmp_path):
    path = tmp_path / "client.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\ntraining:\n  learning_rate: 1e-5  # YAML reads a string here\n  warmup_steps: 3\n"
                    "sampling:\n  engine_kwargs: {enforce_eager: true}\n")
    from_yaml = ArcticRLClientConfig.load(path, training={"warmup_steps": 5}, sampling={"engine_kwargs": {"max_num_seqs": 8}})
    assert (from_yaml.training.learning_rate, from_yaml.training.warmup_steps) == (1e-5, 5)  # merged, not replaced
    assert from_yaml.sampling.engine_kwargs == {"enforce_eager": True, "max_num_seqs": 8}
    assert ArcticRLClientConfig.load(str(path)) == ArcticRLClientConfig.load({"model": "Qwen/Qwen3-0.6B", "training": {
        "learning_rate": 1e-5, "warmup_steps": 3}, "sampling": {"engine_kwargs": {"enforce_eager": True}}})
    again = ArcticRLClientConfig.load(from_yaml, seed=3)
    assert again.seed == 3 and again.training == from_yaml.training
    source = {"model": "m", "training": {"learning_rate": 0.1}}
    ArcticRLClientConfig.load(source, training={"learning_rate": 0.2})
    assert source == {"model": "m", "training": {"learning_rate": 0.1}}  # the caller's dict is not modified
    fresh = ArcticRLClientConfig.load(model="Qwen/Qwen3-0.6B")
    assert ArcticRLClientConfig.load(fresh, model=TINY, tokenizer="t").model == TINY  # a string model is replaced


def test_token_from_env_and_kept_secret(monkeypatch):
    monkeypatch.setenv("ARCTIC_RL_TOKEN", TOKEN)
    cfg = ArcticRLClientConfig.load(model="m")
    assert cfg.auth_token == TOKEN
    assert ArcticRLClientConfig.load(model="m", auth_token="other").auth_token == "other"
    assert ArcticRLClientConfig.load(model="m", auth_token=None).auth_token is None  # explicit null: no token
    assert TOKEN not in repr(cfg) and TOKEN not in str(cfg)
    assert TOKEN not in json.dumps(cfg.to_dict()) and cfg.to_dict()["auth_token"] == "<redacted>"
    assert cfg.to_dict(include_secrets=True)["auth_token"] == TOKEN
    assert ArcticRLClientConfig.load(cfg.to_dict(include_secrets=True)) == cfg
    assert ArcticRLClientConfig.load(cfg) == cfg
    with pytest.raises(ConfigError, match=r"auth_token: is the placeholder to_dict\(\) writes"):
        ArcticRLClientConfig.load(cfg.to_dict())


def test_to_dict_is_json_and_round_trips():
    cfg = ArcticRLClientConfig.load(model=TINY, tokenizer="tok", training={"zero_stage": 2, "deepspeed_config": {"a": [1]}})
    assert ArcticRLClientConfig.load(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("overrides", [
    {"protocol": "http", "server_url": "http://10.0.0.5:8000", "auth_token": TOKEN},
    {"protocol": "http", "server_url": "http://localhost:8000"},
    {"protocol": "http"},  # embedded server
    {"protocol": "ray", "ray_address": "auto"},
    {"server": {"host": "0.0.0.0"}, "auth_token": TOKEN},
    {"sampling": {"num_engines": 4, "gpus_per_engine": 1}},  # protocol local: engines become Ray actors
    {"sampling": {"colocated": True, "gpus_per_engine": 0.4}, "training": {"accelerator": "gpu"}},
    {"sampling": {"gpus_per_engine": 2.0}},
    {"training": {"lr_schedule": "cosine", "total_steps": 100, "warmup_steps": 100}},
    {"training": {"zero_stage": 3, "deepspeed_config": {"zero_optimization": {"stage": 3}}, "offload_optimizer": True}},
    {"training": {"micro_batch_tokens": 4096, "precision": "bf16-mixed"}},
    {"model": TINY, "tokenizer": "Qwen/Qwen3-0.6B"},
    {"training": {"devices": 2, "zero_stage": 1, "accelerator": "cpu"}, "sampling": {"engine": "transformers"}},  # gloo
    {"training": {"devices": 4, "zero_stage": 3, "num_nodes": 1}, "protocol": "http", "sampling": {"engine": "transformers"}},
])
def test_consistent_configs_load(overrides):
    ArcticRLClientConfig.load({"model": "m"}, **overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"sampling": {"num_engines": 0}}, "sampling.num_engines: Input should be greater than or equal to 1 (got 0)"),
    ({"training": {"lr": 1}}, "training.lr: unknown field; known fields here: accelerator, devices, num_nodes, zero_stage, "),
    ({"modle": "x"}, "modle: unknown field; known fields here: protocol, server_url, ray_address, auth_token, model, "),
    ({"model": None}, "model: must be a folder or hub id (a non-empty string) or a config dict with a model_type (got None)"),
    ({"model": "  "}, "model: must be a folder or hub id"),
    ({"model": {"hidden_size": 8}, "tokenizer": "t"}, "model: must be a folder or hub id"),
    ({"model": TINY}, "tokenizer: required when model is a config dict"),
    ({"training": {"lr_schedule": "cosine"}}, "training.total_steps: required with lr_schedule 'cosine'"),
    ({"training": {"lr_schedule": "linear", "total_steps": 0}}, "training.total_steps: Input should be greater than or equal to 1"),
    ({"training": {"total_steps": 10, "warmup_steps": 11}}, "training.warmup_steps: 11 is more than total_steps=10"),
    ({"training": {"micro_batch_size": 2, "micro_batch_tokens": 64}},
     "training.micro_batch_size: set training.micro_batch_size or training.micro_batch_tokens, not both"),
    ({"training": {"deepspeed_config": {"train_batch_size": 8}}}, "training.deepspeed_config: needs zero_stage 1, 2 or 3"),
    ({"training": {"zero_stage": 2, "deepspeed_config": {"zero_optimization": {"stage": 3}}}},
     "training.deepspeed_config: zero_optimization.stage=3 contradicts zero_stage=2"),
    ({"training": {"offload_optimizer": True}}, "training.offload_optimizer: needs zero_stage 1, 2 or 3"),
    ({"training": {"devices": 2}}, "training.zero_stage: devices=2 needs zero_stage 1, 2 or 3"),
    ({"training": {"devices": 2, "zero_stage": 2}}, "sampling.engine: training.devices=2 needs 'transformers' for now, got 'auto'"),
    ({"training": {"num_nodes": 2, "zero_stage": 2}}, "training.num_nodes: the service's training processes run on one machine"),
    ({"training": {"num_nodes": 0}}, "training.num_nodes: Input should be greater than or equal to 1 (got 0)"),
    ({"training": {"devices": 2, "zero_stage": 2}, "sampling": {"num_engines": 2, "engine": "transformers"}},
     "sampling.num_engines: a Ray engine pool behind training.devices=2 ranks is not supported yet"),
    ({"training": {"zero_stage": 4}}, "training.zero_stage: Input should be 0, 1, 2 or 3 (got 4)"),
    ({"lora": {"rank": 4}, "training": {"zero_stage": 3}},
     "lora.rank: 4 needs training.zero_stage 0, 1 or 2, not 3"),
    ({"training": {"precision": "bf16"}}, "training.precision: must be one of 32-true, 64-true, 16-true, bf16-true, "),
    ({"training": {"learning_rate": float("nan")}}, "training.learning_rate: Input should be a finite number"),
    ({"training": {"max_grad_norm": 0}}, "training.max_grad_norm: Input should be greater than 0 (got 0)"),
    ({"protocol": "grpc"}, "protocol: Input should be 'local', 'http' or 'ray' (got 'grpc')"),
    ({"protocol": "http", "server_url": "http://10.0.0.5:8000"},
     "auth_token: required for the non-loopback server '10.0.0.5' (or set ARCTIC_RL_TOKEN)"),
    ({"protocol": "http", "server_url": "localhost:8000"}, "server_url: must look like http://host:port"),
    ({"protocol": "http", "server_url": "http://h:99999"}, "server_url: not a URL: Port out of range"),
    ({"server_url": "http://127.0.0.1:8000"}, "server_url: only used with protocol 'http', but protocol is 'local'"),
    ({"ray_address": "auto", "protocol": "http"}, "ray_address: only used with protocol 'ray', but protocol is 'http'"),
    ({"server": {"host": "0.0.0.0"}},
     "server.host: refusing to listen on 0.0.0.0 without an auth token: set auth_token or ARCTIC_RL_TOKEN"),
    ({"server": {"port": 70000}}, "server.port: Input should be less than or equal to 65535 (got 70000)"),
    ({"server": {"root_dir": ""}}, "server.root_dir: String should have at least 1 character"),
    ({"timeouts": {"call_s": 0}}, "timeouts.call_s: Input should be greater than 0 (got 0)"),
    ({"sampling": {"colocated": True}}, "sampling.gpus_per_engine: colocated engines share a GPU with training"),
    ({"sampling": {"gpus_per_engine": 1.5}}, "sampling.gpus_per_engine: above 1 it must be a whole number"),
    ({"sampling": {"colocated": True, "gpus_per_engine": 0.5}, "training": {"accelerator": "cpu"}},
     "sampling.colocated: engines can only share training GPUs, but training.accelerator is 'cpu'"),
    ({"sampling": {"temperature": 0.0}}, "sampling.temperature: Input should be greater than 0"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0 (got -1)"),
    ({"training": 3}, "training: Input should be a valid dictionary or instance of TrainingConfig (got 3)"),
    ({"auth_token": ""}, "auth_token: String should have at least 1 character (got <redacted>)"),
])
def test_bad_fields_name_their_path(overrides, message):
    with pytest.raises(ConfigError) as info:
        ArcticRLClientConfig.load({"model": "m"}, **overrides)
    assert str(info.value).startswith("invalid client config: ")
    assert message in str(info.value)


def test_a_missing_model_and_several_errors_are_listed_together():
    with pytest.raises(ConfigError) as info:
        ArcticRLClientConfig.load(sampling={"num_engines": 0}, training={"devices": 0})
    assert str(info.value).splitlines() == [
        "invalid client config (3 errors):",
        "  model: Field required",
        "  training.devices: Input should be greater than or equal to 1 (got 0)",
        "  sampling.num_engines: Input should be greater than or equal to 1 (got 0)",
    ]


def test_a_bad_token_is_never_shown():
    with pytest.raises(ConfigError) as info:
        ArcticRLClientConfig.load(model="m", auth_token=["tok-9f8e7d"])
    assert "auth_token: Input should be a valid string (got <redacted>)" in str(info.value)
    assert TOKEN not in str(info.value)


@pytest.mark.parametrize("content, message", [
    (None, r"client.yaml: config file does not exist"),
    ("model: [unclosed", r"client.yaml: not valid YAML"),
    ("- model: m\n", r"client.yaml: expected a mapping of config fields, got list"),
    ("", r"client.yaml: invalid client config: model: Field required"),
    ("model: m\nsampling: {num_engines: 0}\n", r"client.yaml: invalid client config: sampling.num_engines: "),
])
def test_yaml_files(tmp_path, content, message):
    path = tmp_path / "client.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path)) + "/" + message):
        ArcticRLClientConfig.load(path)


def test_a_source_of_another_type_is_refused():
    with pytest.raises(ConfigError, match="config source must be a dict, a YAML path or an ArcticRLClientConfig, got int"):
        ArcticRLClientConfig.load(3)


def dotted_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    names = []
    for name, info in model.model_fields.items():
        names.append(prefix + name)
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            names += dotted_fields(info.annotation, f"{prefix}{name}.")
    return names


def test_config_reference_lists_every_field_once_in_order(monkeypatch):
    text = config_reference_markdown()
    rows = text.splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == dotted_fields(ArcticRLClientConfig)
    assert len(dotted_fields(ArcticRLClientConfig)) == 58  # 14 top-level, 19 training, 9 sampling, 4 zorro, 3 lora, 3 timeouts, 6 server
    assert all(row.count(" | ") == 3 for row in rows)  # "|" inside cells is escaped
    assert r'| `training.zero_stage` | `0 \| 1 \| 2 \| 3` | `0` |' in text
    assert r'| `sampling.num_engines` | `int`, >= 1 | `1` |' in text
    assert r"| `model` | `str \| dict[str, Any] \| None` | required |" in text
    monkeypatch.setenv("ARCTIC_RL_TOKEN", TOKEN)
    assert config_reference_markdown() == text  # independent of the environment


def test_an_http_client_of_a_running_server_may_leave_the_model_out():
    """The server owns its model (a client naming another is refused at its first call: test_service_guards)."""
    config = ArcticRLClientConfig.load(protocol="http", server_url="http://127.0.0.1:8000")
    assert config.model is None
    for without_server in ({"protocol": "http"}, {"protocol": "local"}, {"protocol": "ray"}):
        with pytest.raises(ConfigError, match="model: Field required"):
            ArcticRLClientConfig.load(**without_server)
    with pytest.raises(ConfigError, match="model: must be a folder or hub id"):
        ArcticRLClientConfig.load(model=None)


def test_module_options_are_grpo_modules_sections_as_the_config_sets_them():
    from arctic_rl.modules.lora import LoraOptions
    from arctic_rl.modules.options import ComputeOptions, OptimOptions, SamplingOptions

    config = ArcticRLClientConfig.load({
        "model": "m", "seed": 3,
        "training": {"learning_rate": 1e-5, "lr_schedule": "linear", "total_steps": 10, "warmup_steps": 2, "weight_decay": 0.1,
                     "max_grad_norm": 0.5, "micro_batch_tokens": 64, "gradient_checkpointing": True},
        "sampling": {"max_prompt_length": 16, "max_response_length": 8, "temperature": 0.7},
        "zorro": {"enabled": False, "attention_backend": "sdpa", "self_check": False},
        "lora": {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}})
    assert config.module_options() == {
        "sampling": SamplingOptions(group_size=2, max_prompt_length=16, max_response_length=8, temperature=0.7, seed=3),
        "optim": OptimOptions(learning_rate=1e-5, lr_schedule="linear", warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5),
        "compute": ComputeOptions(micro_batch_tokens=64, gradient_checkpointing=True, zorro=False, attention_backend="sdpa",
                                  self_check=False),
        "lora": LoraOptions(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]),
    }
    defaults = ArcticRLClientConfig.load({"model": "m"}).module_options()  # the client's defaults are the options'
    assert defaults == {"sampling": SamplingOptions(group_size=2), "optim": OptimOptions(), "compute": ComputeOptions(),
                        "lora": LoraOptions()}
