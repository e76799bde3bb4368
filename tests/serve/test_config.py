"""``ArcticRLClientConfig.load``: sources, overrides, the token, one ``ConfigError`` naming every bad field,
the cross-field rules, and the generated config reference."""

import dataclasses
import json
import re
import warnings

import pytest
from pydantic import BaseModel, ValidationError

from arctic_rl.errors import ConfigError
from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.config_reference import config_reference_markdown

TOKEN = "tok-9f8e7d"
TINY = {"model_type": "qwen3", "hidden_size": 16}


@pytest.fixture(autouse=True)
def no_env_token(monkeypatch):
    monkeypatch.delenv("ARCTIC_RL_TOKEN", raising=False)


def test_defaults():
    cfg = ArcticRLClientConfig.load(model="Qwen/Qwen3-0.6B")
    assert (cfg.protocol, cfg.server_url, cfg.auth_token, cfg.dtype, cfg.sampling.seed) == ("local", None, None, "float32", 0)
    assert (cfg.training.zero_stage, cfg.optim.learning_rate, cfg.training.precision) == (0, 1e-6, "32-true")
    assert (cfg.engines.engine, cfg.engines.num_engines, cfg.engines.engine_kwargs) == ("auto", 1, {})
    assert (cfg.engines.num_gpus_per_engine, cfg.engines.num_cpus_per_engine, cfg.engines.colocated) == (0.0, 1.0, False)
    assert (cfg.compute.zorro, cfg.timeouts.call_s, cfg.server.host, cfg.server.port) == (True, 600.0, "127.0.0.1", 0)
    with pytest.raises(ValidationError):
        cfg.training.precision = "bf16-mixed"  # frozen: change a config through load(cfg, **overrides)


def test_sources_and_recursive_overrides(tmp_path):
    path = tmp_path / "client.yaml"
    path.write_text("model: Qwen/Qwen3-0.6B\noptim:\n  learning_rate: 1e-5  # YAML reads a string here\n  warmup_steps: 3\n"
                    "engines:\n  engine_kwargs: {enforce_eager: true}\n")
    from_yaml = ArcticRLClientConfig.load(path, optim={"warmup_steps": 5}, engines={"engine_kwargs": {"max_num_seqs": 8}})
    assert (from_yaml.optim.learning_rate, from_yaml.optim.warmup_steps) == (1e-5, 5)  # merged, not replaced
    assert from_yaml.engines.engine_kwargs == {"enforce_eager": True, "max_num_seqs": 8}
    assert ArcticRLClientConfig.load(str(path)) == ArcticRLClientConfig.load({"model": "Qwen/Qwen3-0.6B", "optim": {
        "learning_rate": 1e-5, "warmup_steps": 3}, "engines": {"engine_kwargs": {"enforce_eager": True}}})
    again = ArcticRLClientConfig.load(from_yaml, sampling={"seed": 3})
    assert again.sampling.seed == 3 and again.optim == from_yaml.optim
    source = {"model": "m", "optim": {"learning_rate": 0.1}}
    ArcticRLClientConfig.load(source, optim={"learning_rate": 0.2})
    assert source == {"model": "m", "optim": {"learning_rate": 0.1}}  # the caller's dict is not modified
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
    {"protocol": "ray", "ray": {"address": "auto"}},
    {"training": {"num_nodes": 2, "zero_stage": 2, "launcher": "ray", "accelerator": "cpu"}, "engines": {"engine": "transformers"},
     "ray": {"address": "10.0.0.1:6379", "placement_strategy": "SPREAD", "cpus_per_worker": 2}},  # rank actors over nodes
    {"training": {"devices": 8, "num_nodes": 4, "zero_stage": 3, "launcher": "ray", "accelerator": "gpu"},
     "engines": {"engine": "transformers"}, "ray": {"address": "auto", "gpus_per_worker": 1}},
    {"server": {"host": "0.0.0.0"}, "auth_token": TOKEN},
    {"engines": {"num_engines": 4, "num_gpus_per_engine": 1}},  # protocol local: engines become Ray actors
    # vLLM replicas as Ray actors beside several ranks: local rank processes, or rank actors over nodes
    {"training": {"devices": 2, "zero_stage": 2}, "engines": {"engine": "vllm", "num_engines": 2}, "ray": {"address": "auto"}},
    {"training": {"devices": 2, "zero_stage": 3}, "engines": {"engine": "vllm", "launcher": "ray"}},
    {"training": {"num_nodes": 2, "zero_stage": 2, "launcher": "ray"}, "engines": {"num_engines": 2},
     "ray": {"address": "auto", "placement_strategy": "SPREAD"}},
    {"engines": {"colocated": True, "num_gpus_per_engine": 0.4}, "training": {"accelerator": "gpu"}},
    # colocated replicas in the rank actors' bundles: on CPU, and a GPU shared by a rank and its replica
    {"training": {"devices": 2, "zero_stage": 2, "launcher": "ray", "accelerator": "cpu"}, "engines": {"colocated": True, "num_engines": 2}},
    {"training": {"devices": 8, "num_nodes": 4, "zero_stage": 3, "launcher": "ray", "accelerator": "gpu"}, "ray": {"gpus_per_worker": 0.5},
     "engines": {"colocated": True, "launcher": "ray", "num_engines": 32, "num_gpus_per_engine": 0.5}},
    {"engines": {"num_gpus_per_engine": 2.0}},
    {"optim": {"lr_schedule": "cosine", "warmup_steps": 100}, "training": {"total_steps": 100}},
    {"training": {"zero_stage": 3, "deepspeed_config": {"zero_optimization": {"stage": 3}}, "offload_optimizer": True}},
    {"compute": {"micro_batch_tokens": 4096}, "training": {"precision": "bf16-mixed"}},
    {"model": TINY, "tokenizer": "Qwen/Qwen3-0.6B"},
    {"training": {"devices": 2, "zero_stage": 1, "accelerator": "cpu"}, "engines": {"engine": "transformers"}},  # gloo
    {"training": {"devices": 4, "zero_stage": 3, "num_nodes": 1}, "protocol": "http", "engines": {"engine": "transformers"}},
])
def test_consistent_configs_load(overrides):
    ArcticRLClientConfig.load({"model": "m"}, **overrides)


@pytest.mark.parametrize("overrides, message", [
    ({"engines": {"num_engines": 0}}, "engines.num_engines: Input should be greater than or equal to 1 (got 0)"),
    ({"training": {"lr": 1}}, "training.lr: unknown field; known fields here: accelerator, devices, num_nodes, launcher, zero_stage, "),
    ({"modle": "x"}, "modle: unknown field; known fields here: protocol, server_url, auth_token, model, tokenizer, "),
    ({"model": None}, "model: must be a folder or hub id (a non-empty string) or a config dict with a model_type (got None)"),
    ({"model": "  "}, "model: must be a folder or hub id"),
    ({"model": {"hidden_size": 8}, "tokenizer": "t"}, "model: must be a folder or hub id"),
    ({"model": TINY}, "tokenizer: required when model is a config dict"),
    ({"optim": {"lr_schedule": "cosine"}}, "training.total_steps: required with optim.lr_schedule 'cosine'"),
    ({"optim": {"lr_schedule": "linear"}, "training": {"total_steps": 0}},
     "training.total_steps: Input should be greater than or equal to 1"),
    ({"training": {"total_steps": 10}, "optim": {"warmup_steps": 11}},
     "optim.warmup_steps: 11 is more than training.total_steps=10"),
    ({"compute": {"micro_batch_size": 2, "micro_batch_tokens": 64}},
     "compute: set compute.micro_batch_size or compute.micro_batch_tokens, not both"),
    ({"optim": {"min_lr_ratio": 0.1}}, "optim.min_lr_ratio and num_cycles shape the cosine schedule: set optim.lr_schedule"),
    ({"optim": {"mini_batches": 2}}, "optim.mini_batches: and optim.num_iterations shape arctic-rl fit's steps"),
    ({"optim": {"learning_rat": 1e-5}}, "optim.learning_rat: unknown field; known fields here: learning_rate, lr_schedule, "),
    ({"training": {"deepspeed_config": {"train_batch_size": 8}}}, "training.deepspeed_config: needs zero_stage 1, 2 or 3"),
    ({"training": {"zero_stage": 2, "deepspeed_config": {"zero_optimization": {"stage": 3}}}},
     "training.deepspeed_config: zero_optimization.stage=3 contradicts zero_stage=2"),
    ({"training": {"offload_optimizer": True}}, "training.offload_optimizer: needs zero_stage 1, 2 or 3"),
    ({"training": {"devices": 2}}, "training.zero_stage: devices=2 needs zero_stage 1, 2 or 3"),
    ({"training": {"devices": 2, "zero_stage": 2}}, "engines.engine: 'auto' with training.devices=2 needs engines.launcher: ray "
     "(the engines as Ray actors beside the ranks), or engine 'transformers': an in-process vLLM engine on rank 0 joins"),
    ({"training": {"num_nodes": 2, "zero_stage": 2}}, "training.num_nodes: 2 nodes need launcher: ray (rank actors placed on a Ray"),
    ({"training": {"num_nodes": 2, "launcher": "ray"}}, "training.zero_stage: devices=1 x num_nodes=2 needs zero_stage 1, 2 or 3"),
    ({"training": {"num_nodes": 2, "zero_stage": 1, "launcher": "ray"}},
     "engines.engine: 'auto' with training.devices=1 x num_nodes=2 needs engines.launcher: ray"),
    ({"training": {"launcher": "slurm"}}, "training.launcher: Input should be 'processes' or 'ray' (got 'slurm')"),
    ({"ray": {"placement_strategy": "pack"}}, "ray.placement_strategy: Input should be 'PACK', 'SPREAD', 'STRICT_PACK' or "),
    ({"ray": {"cpus_per_worker": 0}}, "ray.cpus_per_worker: Input should be greater than 0 (got 0)"),
    ({"training": {"launcher": "ray", "accelerator": "gpu"}},
     "ray.gpus_per_worker: 0 with training.accelerator 'gpu': give each rank 1 GPU with accelerator gpu, none with cpu"),
    ({"training": {"launcher": "ray", "accelerator": "cpu"}, "ray": {"gpus_per_worker": 1}},
     "ray.gpus_per_worker: 1 with training.accelerator 'cpu'"),
    ({"training": {"num_nodes": 0}}, "training.num_nodes: Input should be greater than or equal to 1 (got 0)"),
    ({"engines": {"num_engines": 2, "launcher": "in_process"}},
     "engines.num_engines: 2 engines cannot all live in one process: set launcher: ray (or auto) to run them as Ray actors"),
    ({"engines": {"launcher": "docker"}}, "engines.launcher: Input should be 'auto', 'in_process' or 'ray' (got 'docker')"),
    ({"training": {"zero_stage": 4}}, "training.zero_stage: Input should be 0, 1, 2 or 3 (got 4)"),
    ({"lora": {"rank": 4}, "training": {"zero_stage": 3}},
     "lora.rank: 4 needs training.zero_stage 0, 1 or 2, not 3"),
    ({"training": {"precision": "bf16"}}, "training.precision: must be one of 32-true, 64-true, 16-true, bf16-true, "),
    ({"optim": {"learning_rate": float("nan")}}, "optim.learning_rate: Input should be a finite number (got nan)"),
    ({"optim": {"max_grad_norm": -1.0}}, "optim.max_grad_norm must be a finite number in [0.0, inf], got -1.0"),
    ({"compute": {"zorro_dedup": "tree", "zorro": False}}, "compute.zorro_dedup 'tree' is a ZoRRo packing: it needs compute.zorro"),
    ({"protocol": "grpc"}, "protocol: Input should be 'local', 'http' or 'ray' (got 'grpc')"),
    ({"protocol": "http", "server_url": "http://10.0.0.5:8000"},
     "auth_token: required for the non-loopback server '10.0.0.5' (or set ARCTIC_RL_TOKEN)"),
    ({"protocol": "http", "server_url": "localhost:8000"}, "server_url: must look like http://host:port"),
    ({"protocol": "http", "server_url": "http://h:99999"}, "server_url: not a URL: Port out of range"),
    ({"server_url": "http://127.0.0.1:8000"}, "server_url: only used with protocol 'http', but protocol is 'local'"),
    ({"ray": {"address": "auto"}, "protocol": "http"},
     "ray.address: only used with protocol 'ray', training.launcher 'ray' or engines on Ray, but protocol is 'http', "
     "training.launcher 'processes' and the engines run in process"),
    ({"server": {"host": "0.0.0.0"}},
     "server.host: refusing to listen on 0.0.0.0 without an auth token: set auth_token or ARCTIC_RL_TOKEN"),
    ({"server": {"port": 70000}}, "server.port: Input should be less than or equal to 65535 (got 70000)"),
    ({"server": {"root_dir": ""}}, "server.root_dir: String should have at least 1 character"),
    ({"timeouts": {"call_s": 0}}, "timeouts.call_s: Input should be greater than 0 (got 0)"),
    ({"engines": {"colocated": True}}, "engines.num_gpus_per_engine: colocated engines share a GPU with training"),
    ({"engines": {"num_gpus_per_engine": 1.5}}, "engines.num_gpus_per_engine: above 1 it must be a whole number"),
    ({"engines": {"colocated": True, "num_gpus_per_engine": 0.5}, "training": {"accelerator": "cpu"}},
     "engines.colocated: engines can only share training GPUs, but training.accelerator is 'cpu'"),
    ({"training": {"launcher": "ray", "accelerator": "cpu"}, "engines": {"colocated": True}},
     "engines.launcher: 'auto' with colocated and training.launcher ray: the replicas are Ray actors in the ranks' "
     "placement bundles; set engines.launcher: ray"),
    ({"training": {"launcher": "ray", "accelerator": "cpu"}, "engines": {"colocated": True, "launcher": "ray", "num_engines": 2}},
     "engines.num_engines: 2 colocated replicas for 1 training ranks: each replica shares one rank's bundle"),
    ({"training": {"launcher": "ray", "accelerator": "gpu"}, "ray": {"gpus_per_worker": 1},
      "engines": {"colocated": True, "launcher": "ray", "num_gpus_per_engine": 0.5}},
     "engines.num_gpus_per_engine: 0.5 beside ray.gpus_per_worker=1: a rank and its colocated replica share one GPU"),
    ({"sampling": {"temperature": 0.0}}, "sampling.temperature: Input should be greater than 0"),
    ({"sampling": {"seed": -1}}, "sampling.seed: Input should be greater than or equal to 0 (got -1)"),
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
        ArcticRLClientConfig.load(engines={"num_engines": 0}, training={"devices": 0})
    assert str(info.value).splitlines() == [
        "invalid client config (3 errors):",
        "  model: Field required",
        "  training.devices: Input should be greater than or equal to 1 (got 0)",
        "  engines.num_engines: Input should be greater than or equal to 1 (got 0)",
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
    ("model: m\nengines: {num_engines: 0}\n", r"client.yaml: invalid client config: engines.num_engines: "),
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
        if dataclasses.is_dataclass(info.annotation):  # a section shared with fit (modules/options.py)
            names += [f"{prefix}{name}.{f.name}" for f in dataclasses.fields(info.annotation)]
    return names


def test_config_reference_lists_every_field_once_in_order(monkeypatch):
    text = config_reference_markdown()
    rows = text.splitlines()[2:]
    assert [row.split("`")[1] for row in rows] == dotted_fields(ArcticRLClientConfig)
    assert len(dotted_fields(ArcticRLClientConfig)) == 71  # 15 top-level, 10 training, 7 engines, 4 sampling, 9 optim, 10 compute, 3 lora, 4 ray, 3 timeouts, 6 server
    assert "| `optim.learning_rate` | `float` | `1e-06` | AdamW learning rate. |" in text  # the option's own default and docs
    assert all(row.count(" | ") == 3 for row in rows)  # "|" inside cells is escaped
    assert r'| `training.zero_stage` | `0 \| 1 \| 2 \| 3` | `0` |' in text
    assert r'| `engines.num_engines` | `int`, >= 1 | `1` |' in text
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
        "model": "m", "training": {"total_steps": 10},
        "optim": {"learning_rate": 1e-5, "lr_schedule": "linear", "warmup_steps": 2, "weight_decay": 0.1, "max_grad_norm": 0.5},
        "compute": {"micro_batch_tokens": 64, "gradient_checkpointing": True, "zorro": False, "attention_backend": "sdpa",
                    "self_check": False},
        "sampling": {"max_prompt_length": 16, "max_response_length": 8, "temperature": 0.7, "seed": 3},
        "lora": {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}})
    assert config.module_options() == {  # group_size None: the service's requests carry their own groups
        "sampling": SamplingOptions(group_size=None, max_prompt_length=16, max_response_length=8, temperature=0.7, seed=3),
        "optim": OptimOptions(learning_rate=1e-5, lr_schedule="linear", warmup_steps=2, weight_decay=0.1, max_grad_norm=0.5),
        "compute": ComputeOptions(micro_batch_tokens=64, gradient_checkpointing=True, zorro=False, attention_backend="sdpa",
                                  self_check=False),
        "lora": LoraOptions(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"]),
    }
    defaults = ArcticRLClientConfig.load({"model": "m"}).module_options()  # the client's defaults are the options'
    assert defaults == {"sampling": SamplingOptions(group_size=None), "optim": OptimOptions(), "compute": ComputeOptions(),
                        "lora": LoraOptions()}


def test_old_client_keys_load_with_one_warning_naming_the_new_key():
    from arctic_rl.modules.flat_options import DeprecatedOptionKey
    from arctic_rl.serve.config import OLD_KEYS

    old = {"seed": 3, "training": {"learning_rate": 1e-5, "micro_batch_size": 2, "accelerator": "cpu"},
           "zorro": {"enabled": False, "dedup": "group", "attention_backend": "sdpa", "self_check": False},
           "protocol": "ray", "ray_address": "auto"}
    new = {"sampling": {"seed": 3}, "training": {"accelerator": "cpu"}, "optim": {"learning_rate": 1e-5},
           "protocol": "ray", "ray": {"address": "auto"},
           "compute": {"micro_batch_size": 2, "zorro": False, "zorro_dedup": "group", "attention_backend": "sdpa", "self_check": False}}
    with pytest.warns(DeprecatedOptionKey) as caught:
        loaded = ArcticRLClientConfig.load({"model": "m", **old})
    assert sorted(str(w.message) for w in caught) == sorted(
        f"{key} is deprecated and will be removed in the next release; use {OLD_KEYS[key]}"
        for key in ("seed", "training.learning_rate", "training.micro_batch_size", "zorro.enabled", "zorro.dedup",
                    "zorro.attention_backend", "zorro.self_check", "ray_address"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded == ArcticRLClientConfig.load({"model": "m", **new})  # the new keys: no warning
    with pytest.raises(ConfigError, match=r"^invalid client config: zorro.dedup and compute.zorro_dedup both set one option: keep"
                                          r" only compute.zorro_dedup \(zorro.dedup is deprecated\)$"):
        ArcticRLClientConfig.load({"model": "m", "zorro": {"dedup": "tree"}, "compute": {"zorro_dedup": "group"}})


def test_the_engine_keys_of_the_old_sampling_section_load_into_engines_with_one_warning_each():
    from arctic_rl.modules.flat_options import DeprecatedOptionKey

    engines = {"engine": "transformers", "num_engines": 2, "colocated": True, "engine_kwargs": {"enforce_eager": True}}
    old = {"sampling": {**engines, "gpus_per_engine": 0.5, "cpus_per_engine": 2.0, "temperature": 0.7}, "training": {"accelerator": "gpu"}}
    new = {"engines": {**engines, "num_gpus_per_engine": 0.5, "num_cpus_per_engine": 2.0}, "sampling": {"temperature": 0.7},
           "training": {"accelerator": "gpu"}}
    with pytest.warns(DeprecatedOptionKey) as caught:
        loaded = ArcticRLClientConfig.load({"model": "m", **old})
    assert sorted(str(w.message) for w in caught) == sorted(
        f"sampling.{old_name} is deprecated and will be removed in the next release; use engines.{new_name}"
        for old_name, new_name in (("engine", "engine"), ("num_engines", "num_engines"), ("colocated", "colocated"),
                                   ("engine_kwargs", "engine_kwargs"), ("gpus_per_engine", "num_gpus_per_engine"),
                                   ("cpus_per_engine", "num_cpus_per_engine")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded == ArcticRLClientConfig.load({"model": "m", **new})
    assert (loaded.engines.num_gpus_per_engine, loaded.engines.num_cpus_per_engine, loaded.sampling.temperature) == (0.5, 2.0, 0.7)
    with pytest.raises(ConfigError, match=r"^invalid client config: sampling.gpus_per_engine and engines.num_gpus_per_engine both set"
                                          r" one option: keep only engines.num_gpus_per_engine \(sampling.gpus_per_engine is deprecated\)$"):
        ArcticRLClientConfig.load({"model": "m", "sampling": {"gpus_per_engine": 0.5}, "engines": {"num_gpus_per_engine": 0.25}})
    with pytest.warns(DeprecatedOptionKey), pytest.raises(ConfigError, match="engines.num_gpus_per_engine: above 1 it must be a whole"):
        ArcticRLClientConfig.load({"model": "m", "sampling": {"gpus_per_engine": 1.5}})  # a bad value named by its new key
