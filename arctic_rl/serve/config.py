"""``ArcticRLClientConfig``: what an ``ArcticRLClient`` starts (model, training, rollout engines, server)
and how it reaches it, validated once by ``ArcticRLClientConfig.load`` into a frozen pydantic model.

``load`` is the front door: it reads a dict, a YAML file or an existing config, merges keyword
overrides into it, and turns every validation error into one ``ConfigError`` listing each bad field by
its dotted path. ``config_reference_markdown()`` renders the README's config reference from the models.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from arctic_rl.errors import ConfigError
from arctic_rl.checkpointing import GradientCheckpointing
from arctic_rl.modules.lora import LoraOptions
from arctic_rl.rollout.engines.kinds import EngineChoice
from arctic_rl.modules.options import SECTIONS, AttentionBackend, ComputeOptions, OptimOptions, SamplingOptions
from arctic_rl.serve.security import DEFAULT_MAX_REQUEST_MB, is_loopback

TOKEN_ENV = "ARCTIC_RL_TOKEN"
REDACTED = "<redacted>"  # what ``to_dict()`` writes instead of the token
# Lightning's precision strings (lightning.fabric.plugins.precision.precision._PRECISION_INPUT_STR)
# GRPOModule's options (modules/options.py) the client sets, "<section>.<field>" -> the client config's path: the
# options' defaults and rules are theirs (each field's default below is its option's; ``module_options`` checks the rest)
MODULE_OPTIONS = {
    "sampling.max_prompt_length": "sampling.max_prompt_length", "sampling.max_response_length": "sampling.max_response_length",
    "sampling.temperature": "sampling.temperature", "sampling.seed": "seed",
    "optim.learning_rate": "training.learning_rate", "optim.lr_schedule": "training.lr_schedule",
    "optim.warmup_steps": "training.warmup_steps", "optim.weight_decay": "training.weight_decay",
    "optim.min_lr_ratio": "training.min_lr_ratio", "optim.num_cycles": "training.num_cycles",
    "optim.max_grad_norm": "training.max_grad_norm",
    "compute.micro_batch_size": "training.micro_batch_size", "compute.micro_batch_tokens": "training.micro_batch_tokens",
    "compute.gradient_checkpointing": "training.gradient_checkpointing",
    "compute.zorro": "zorro.enabled", "compute.attention_backend": "zorro.attention_backend", "compute.self_check": "zorro.self_check",
    "compute.zorro_dedup": "zorro.dedup",
    "lora.rank": "lora.rank", "lora.alpha": "lora.alpha", "lora.target_modules": "lora.target_modules",
}
SERVICE_GROUP_SIZE = 2  # the module's group_size is unused by the service (requests carry their own groups); 2 passes its check
_SAMPLING, _OPTIM, _COMPUTE, _LORA = SamplingOptions(), OptimOptions(), ComputeOptions(), LoraOptions()
PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed",
              "transformer-engine", "transformer-engine-float16")


def _inconsistent(field: str, reason: str) -> PydanticCustomError:
    """A cross-field error; ``field`` is the path (relative to the model raising it) the message names."""
    return PydanticCustomError("inconsistent", "{field}: {reason}", {"field": field, "reason": reason})


class _Section(BaseModel):
    """Base of every config model: unknown fields, NaN and infinity are errors; validated once, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TrainingConfig(_Section):
    """How the policy is trained: devices, DeepSpeed, optimizer and schedule, micro-batching."""

    accelerator: Literal["auto", "cpu", "gpu"] = Field("auto", description="Lightning accelerator of the training processes.")
    devices: int = Field(1, ge=1, description="Training processes (DeepSpeed ranks) behind the service, one per device; "
                                              "more than 1 needs zero_stage >= 1 (gloo on CPU).")
    num_nodes: int = Field(1, ge=1, description="Machines the training processes span; only 1 for now.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="0: plain torch, no DeepSpeed; 1-3: ArcticStrategy (DeepSpeed ZeRO stage).")
    deepspeed_config: dict[str, Any] | None = Field(
        None, description="Raw DeepSpeed config keys merged over the typed ones (passthrough); needs zero_stage >= 1.")
    offload_optimizer: bool = Field(False, description="ZeRO: keep optimizer states in CPU memory; needs zero_stage >= 1.")
    precision: str = Field("32-true", description=f"Lightning precision, one of {', '.join(PRECISIONS)}.")
    learning_rate: float = Field(_OPTIM.learning_rate, gt=0, description="AdamW peak learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        _OPTIM.lr_schedule, description="Learning-rate schedule after warmup; linear and cosine decay to 0 at total_steps.")
    warmup_steps: int = Field(_OPTIM.warmup_steps, ge=0, description="Optimizer steps of linear warmup from 0.")
    min_lr_ratio: float = Field(
        _OPTIM.min_lr_ratio, ge=0, le=1, description="Cosine only: the decay's floor, a fraction of learning_rate (verl's).")
    num_cycles: float = Field(_OPTIM.num_cycles, gt=0, description="Cosine only: waves over the decay; 0.5 decays once (verl's).")
    total_steps: int | None = Field(None, ge=1, description="Schedule length in optimizer steps; required for linear and cosine.")
    weight_decay: float = Field(_OPTIM.weight_decay, ge=0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(_OPTIM.max_grad_norm, gt=0, description="Gradient-norm clipping threshold; null: no clipping.")
    micro_batch_size: int | None = Field(_COMPUTE.micro_batch_size, ge=1, description="Sequences per forward/backward; null: the whole batch at once.")
    micro_batch_tokens: int | None = Field(
        _COMPUTE.micro_batch_tokens, ge=1, description="Token budget per forward/backward (packed micro-batches); excludes micro_batch_size.")
    gradient_checkpointing: GradientCheckpointing = Field(
        _COMPUTE.gradient_checkpointing, description="Recompute activations in backward to save memory: true/full, or selective (keeps matmul outputs).")
    reference_model: bool = Field(
        False, description="Keep a frozen copy of the initial policy for KL penalties (the ref_logprobs processor).")

    @field_validator("precision")
    @classmethod
    def _known_precision(cls, value: str) -> str:
        if value not in PRECISIONS:
            raise PydanticCustomError("precision", "must be one of {known}", {"known": ", ".join(PRECISIONS)})
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainingConfig:
        if self.lr_schedule != "constant" and self.total_steps is None:
            raise _inconsistent("total_steps", f"required with lr_schedule {self.lr_schedule!r} (the schedule's length)")
        if self.lr_schedule != "cosine" and (self.min_lr_ratio, self.num_cycles) != (_OPTIM.min_lr_ratio, _OPTIM.num_cycles):
            raise _inconsistent("min_lr_ratio", f"min_lr_ratio and num_cycles shape the cosine schedule, not {self.lr_schedule!r}")
        if self.total_steps is not None and self.warmup_steps > self.total_steps:
            raise _inconsistent("warmup_steps", f"{self.warmup_steps} is more than total_steps={self.total_steps}")
        if self.zero_stage == 0 and self.deepspeed_config is not None:
            raise _inconsistent("deepspeed_config", "needs zero_stage 1, 2 or 3 (zero_stage 0 runs without DeepSpeed)")
        if self.zero_stage == 0 and self.offload_optimizer:
            raise _inconsistent("offload_optimizer", "needs zero_stage 1, 2 or 3 (offloading is a DeepSpeed ZeRO feature)")
        if self.num_nodes > 1:
            raise _inconsistent("num_nodes", f"the service's training processes run on one machine for now, got {self.num_nodes}; "
                                            "use devices for several processes on it (arctic-rl fit with ray spans machines)")
        if self.devices > 1 and self.zero_stage == 0:
            raise _inconsistent("zero_stage", f"devices={self.devices} needs zero_stage 1, 2 or 3: several backward passes "
                                             "per step, which DeepSpeed's engine reduces over ranks (as arctic-rl fit requires)")
        raw_stage = (self.deepspeed_config or {}).get("zero_optimization", {}).get("stage", self.zero_stage)
        if raw_stage != self.zero_stage:
            raise _inconsistent("deepspeed_config",
                               f"zero_optimization.stage={raw_stage!r} contradicts zero_stage={self.zero_stage}")
        return self


class EnginesConfig(_Section):
    """The rollout engines: which, how many, their resources, and the lengths and temperature they sample at."""

    engine: EngineChoice = Field(
        "auto", description="Rollout engine; auto: vLLM when installed, else transformers.")
    num_engines: int = Field(1, ge=1, description="Engine replicas; more than 1 makes them Ray actors (any protocol, local included).")
    gpus_per_engine: float = Field(
        0.0, ge=0, description="GPUs per engine (Ray resource); a fraction below 1 shares a GPU; above 1, a whole number.")
    cpus_per_engine: float = Field(1.0, gt=0, description="CPUs per engine (Ray resource).")
    colocated: bool = Field(
        False, description="Engines share the training GPUs (they sleep during training); needs 0 < gpus_per_engine < 1.")
    engine_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the engine's constructor (for vLLM: its engine arguments).")
    max_prompt_length: int = Field(_SAMPLING.max_prompt_length, ge=1, description="Longest prompt in tokens.")
    max_response_length: int = Field(_SAMPLING.max_response_length, ge=1, description="Most tokens sampled per response.")
    temperature: float = Field(
        _SAMPLING.temperature, gt=0, description="Sampling temperature, also the one log-probs are computed at (on-policy ratios need both equal).")

    @model_validator(mode="after")
    def _consistent(self) -> EnginesConfig:
        if self.colocated and not 0 < self.gpus_per_engine < 1:
            raise _inconsistent("gpus_per_engine", "colocated engines share a GPU with training: need a fraction in (0, 1),"
                                                  f" got {self.gpus_per_engine}")
        if self.gpus_per_engine > 1 and not self.gpus_per_engine.is_integer():
            raise _inconsistent("gpus_per_engine", f"above 1 it must be a whole number (Ray's rule), got {self.gpus_per_engine}")
        return self


class ZorroConfig(_Section):
    """Zorro: the shared-prompt attention that computes a group's log-probs in one packed forward."""

    enabled: bool = Field(_COMPUTE.zorro, description="Use Zorro packing for training forwards.")
    attention_backend: AttentionBackend = Field(_COMPUTE.attention_backend, description="Zorro's attention kernel.")
    self_check: bool = Field(_COMPUTE.self_check, description="Check Zorro's log-probs against a plain forward on the first batch.")
    dedup: Literal["group", "tree"] = Field(_COMPUTE.zorro_dedup, description="What Zorro computes once: each group's prompt, "
                                            "or (tree) every prefix several sequences share (multi-turn; flex or sdpa).")


class LoraConfig(_Section):
    """LoRA adapters through peft (``modules/lora.py``): the base frozen, the engines given the merged weights,
    ``save_state`` holding the adapters only. Needs the ``lora`` extra."""

    rank: int = Field(_LORA.rank, ge=0, description="Adapter rank; 0: no LoRA, every weight trains; > 0 needs training.zero_stage 0, 1 or 2.")
    alpha: float | None = Field(_LORA.alpha, gt=0, description="lora_alpha: updates scaled by alpha / rank; null: rank (scale 1).")
    target_modules: list[str] | None = Field(
        _LORA.target_modules, min_length=1, description="Linear layers that get adapters (q_proj, ...); null: every linear layer of the decoder.")


class TimeoutsConfig(_Section):
    """How long the client waits, in seconds."""

    startup_s: float = Field(900.0, gt=0, description="First call: model build and engine start.")
    call_s: float = Field(600.0, gt=0, description="Any one operation.")
    connect_s: float = Field(10.0, gt=0, description="Reaching the server.")


class ServerConfig(_Section):
    """The HTTP server (``arctic-rl serve``, or the one an http client embeds)."""

    host: str = Field("127.0.0.1", description="Interface to listen on; anything but loopback needs auth_token.")
    port: int = Field(0, ge=0, le=65535, description="Port to listen on; 0: a free port.")
    root_dir: str = Field(
        "arctic-rl-server", min_length=1, description="Folder that save_state, load_state and export paths are confined to.")
    max_request_mb: float = Field(DEFAULT_MAX_REQUEST_MB, gt=0, description="Largest request body accepted, in MiB.")
    max_samples_per_request: int = Field(
        16384, ge=1, description="Most completions one sample request may ask for (prompts x n; Tinker: num_samples), "
                                 "refused (400) before anything is allocated.")
    max_sample_tokens_per_request: int = Field(
        1 << 26, ge=1, description="Most tokens one sample request may hold: completions x (prompt + max_tokens), "
                                   "refused (400) before anything is allocated.")


class ArcticRLClientConfig(_Section):
    """Everything an ``ArcticRLClient`` needs. Build it with ``ArcticRLClientConfig.load`` (which raises
    ``ConfigError``); calling the class directly raises pydantic's ``ValidationError`` instead.

    ``sampling.num_engines > 1`` is allowed with every protocol, ``local`` included: the engines then
    run as Ray actors beside the in-process core."""

    protocol: Literal["local", "http", "ray"] = Field(
        "local", description="How the client reaches the core: in-process, over HTTP, or as a Ray actor.")
    server_url: str | None = Field(
        None, description="protocol http: the server, http://host:port; null: the client starts an embedded server.")
    ray_address: str | None = Field(
        None, description='protocol ray: the cluster to join ("auto", "ray://host:port"); null: a local cluster the client starts.')
    auth_token: str | None = Field(
        None, min_length=1, repr=False,
        description=f"Bearer token of the HTTP server; when the field is absent, ${TOKEN_ENV}. Never shown in repr or to_dict().")
    model: str | dict[str, Any] | None = Field(
        description="A save_pretrained folder or hub id, or a transformers config dict with model_type (random init). "
                    "With protocol http and a server_url it may be left out (the server's); given, it must be the server's.")
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; null: the model's. Required when model is a dict.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the model weights.")
    seed: int = Field(_SAMPLING.seed, ge=0, description="Seed of initialisation, sampling and data order.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Training (section).")
    sampling: EnginesConfig = Field(default_factory=EnginesConfig, description="Rollout engines (section).")
    zorro: ZorroConfig = Field(default_factory=ZorroConfig, description="Zorro shared-prompt packing (section).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (section).")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Client-side timeouts (section).")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server (section).")

    @model_validator(mode="before")
    @classmethod
    def _token_from_env(cls, data: Any) -> Any:
        if isinstance(data, dict) and "auth_token" not in data and os.environ.get(TOKEN_ENV):
            return {**data, "auth_token": os.environ[TOKEN_ENV]}
        return data

    @field_validator("auth_token")
    @classmethod
    def _not_redacted(cls, value: str | None) -> str | None:
        if value == REDACTED:
            raise PydanticCustomError("redacted", "is the placeholder to_dict() writes; give the token (or set {env})",
                                      {"env": TOKEN_ENV})
        return value

    @model_validator(mode="before")
    @classmethod
    def _model_of_the_server(cls, data: Any) -> Any:
        """An http client of a running server (``server_url``) may leave ``model`` out: the server owns it."""
        if isinstance(data, dict) and "model" not in data and data.get("protocol") == "http" and data.get("server_url"):
            return {**data, "model": None}
        return data

    @field_validator("model", mode="before")
    @classmethod
    def _model_source(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and info.data.get("protocol") == "http" and info.data.get("server_url"):
            return value
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, dict) and isinstance(value.get("model_type"), str):
            return value
        raise PydanticCustomError("model_source", "must be a folder or hub id (a non-empty string) or a config dict with a model_type")

    @field_validator("server_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (raises on a bad port)
        except ValueError as e:
            raise PydanticCustomError("server_url", "not a URL: {error}", {"error": str(e)}) from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PydanticCustomError("server_url", "must look like http://host:port")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ArcticRLClientConfig:
        if isinstance(self.model, dict) and self.tokenizer is None:
            raise _inconsistent("tokenizer", "required when model is a config dict (a fresh model has no tokenizer)")
        if self.server_url is not None and self.protocol != "http":
            raise _inconsistent("server_url", f"only used with protocol 'http', but protocol is {self.protocol!r}")
        if self.ray_address is not None and self.protocol != "ray":
            raise _inconsistent("ray_address", f"only used with protocol 'ray', but protocol is {self.protocol!r}")
        remote = urlsplit(self.server_url).hostname if self.server_url else None
        if remote is not None and not is_loopback(remote) and self.auth_token is None:
            raise _inconsistent("auth_token", f"required for the non-loopback server {remote!r} (or set {TOKEN_ENV})")
        if not is_loopback(self.server.host) and self.auth_token is None:
            raise _inconsistent("server.host", f"refusing to listen on {self.server.host or '<all interfaces>'} "
                                              f"without an auth token: set auth_token or {TOKEN_ENV}")
        if self.training.devices > 1 and self.sampling.engine != "transformers":
            raise _inconsistent("sampling.engine", f"training.devices={self.training.devices} needs 'transformers' for now, got "
                                                  f"{self.sampling.engine!r}: an in-process vLLM engine on rank 0 joins the "
                                                  "ranks' process group at start and waits for the other ranks forever")
        if self.training.devices > 1 and self.sampling.num_engines > 1:
            raise _inconsistent("sampling.num_engines", f"a Ray engine pool behind training.devices={self.training.devices} "
                                                       "ranks is not supported yet; use one engine (rank 0 owns it)")
        if self.lora.rank and self.training.zero_stage == 3:
            raise _inconsistent("lora.rank", f"{self.lora.rank} needs training.zero_stage 0, 1 or 2, not 3 (peft cannot "
                                             "wrap ZeRO-3's partitioned parameters)")
        if self.sampling.colocated and self.training.accelerator == "cpu":
            raise _inconsistent("sampling.colocated", "engines can only share training GPUs, but training.accelerator is 'cpu'")
        return self

    @model_validator(mode="after")
    def _module_options_hold(self) -> ArcticRLClientConfig:
        """The options' own rules (``modules/options.py``), e.g. micro_batch_size excludes micro_batch_tokens,
        with the error naming the client's fields."""
        try:
            self.module_options()
        except ConfigError as e:  # its message names model.<section>.<field>: name the client's field instead
            paths = [MODULE_OPTIONS[m] for m in re.findall(r"model\.(\w+\.\w+)", str(e)) if m in MODULE_OPTIONS]
            message = re.sub(r"model\.(\w+\.\w+)", lambda m: MODULE_OPTIONS.get(m.group(1), m.group(0)), str(e))
            field = paths[0] if paths else "training"
            raise _inconsistent(field, message.removeprefix(f"{field} ")) from None
        return self

    def module_options(self) -> dict[str, Any]:
        """``GRPOModule``'s option sections (``modules/options.py``) this config sets (``MODULE_OPTIONS``), each
        built and checked by its own class; the rest at their defaults."""
        values: dict[str, dict[str, Any]] = {"sampling": {"group_size": SERVICE_GROUP_SIZE}}
        for option, path in MODULE_OPTIONS.items():
            section, field = option.split(".")
            node: Any = self
            for part in path.split("."):
                node = getattr(node, part)
            values.setdefault(section, {})[field] = node
        return {section: SECTIONS[section](**fields) for section, fields in values.items()}

    @classmethod
    def load(cls, source: ConfigSource = None, **overrides: Any) -> ArcticRLClientConfig:
        """Validate ``source`` with ``overrides`` merged in.

        Args:
            source: a dict of fields, a YAML file's path, an existing config, or None (fields from
                ``overrides`` only).
            **overrides: top-level fields; a section's fields as a dict, merged recursively into the
                source's (``training={"learning_rate": 1e-5}`` keeps the other training fields). Dicts
                _merge into dict-valued fields too (``engine_kwargs``, a config-dict ``model``).

        Raises:
            ConfigError: the file cannot be read, or any field is invalid; the message lists every bad
                field by dotted path (``sampling.num_engines: ...``), unknown ones with the known fields.
        """
        origin, data = _read_source(source)
        try:
            return cls.model_validate(_merge(data, overrides))
        except ValidationError as e:
            raise ConfigError(_format_errors(e, origin)) from None

    def to_dict(self, include_secrets: bool = False) -> dict[str, Any]:
        """JSON-able fields, ``load``-able back; ``auth_token`` is ``"<redacted>"`` unless ``include_secrets``."""
        data = self.model_dump(mode="json")
        if data["auth_token"] is not None and not include_secrets:
            data["auth_token"] = REDACTED
        return data


ConfigSource = Mapping[str, Any] | str | os.PathLike | ArcticRLClientConfig | None


def _read_source(source: ConfigSource) -> tuple[str, dict[str, Any]]:
    """``(origin for error messages, a fresh dict of fields)`` of a ``load`` source."""
    if source is None:
        return "", {}
    if isinstance(source, ArcticRLClientConfig):
        return "", source.to_dict(include_secrets=True)
    if isinstance(source, Mapping):
        return "", copy.deepcopy(dict(source))
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config source must be a dict, a YAML path or an ArcticRLClientConfig, got {type(source).__name__}")
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"{path}: config file does not exist (cwd: {os.getcwd()})")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if data is None:
        return str(path), {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields, got {type(data).__name__}")
    return str(path), data


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied: dicts _merge recursively, anything else replaces."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, BaseModel):
            value = value.model_dump()
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _format_errors(error: ValidationError, origin: str) -> str:
    """One line per bad field (``path: reason (got value)``), after ``origin`` when it is a file."""
    lines = [_describe_error(detail) for detail in error.errors()]
    head = f"{origin}: " if origin else ""
    if len(lines) == 1:
        return f"{head}invalid client config: {lines[0]}"
    return f"{head}invalid client config ({len(lines)} errors):\n" + "\n".join(f"  {line}" for line in lines)


def _describe_error(detail: ErrorDetails) -> str:
    """``dotted.path: reason``, with the offending value unless it is missing, unknown or a secret."""
    loc = [str(part) for part in detail["loc"]]
    ctx = detail.get("ctx") or {}
    if detail["type"] == "inconsistent":
        return ".".join([*loc, ctx["field"]]) + f": {ctx['reason']}"
    path = ".".join(loc) or "<config>"
    if detail["type"] == "extra_forbidden":
        return f"{path}: unknown field; known fields here: {', '.join(_fields_at(detail['loc'][:-1]))}"
    if detail["type"] == "missing":
        return f"{path}: {detail['msg']}"
    shown = REDACTED if loc[-1:] == ["auth_token"] else _short_repr(detail["input"])
    return f"{path}: {detail['msg']} (got {shown})"


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the section at ``loc`` (a path of section names from the top)."""
    model: type[BaseModel] = ArcticRLClientConfig
    for part in loc:
        model = model.model_fields[str(part)].annotation  # type: ignore[assignment]  (sections only)
    return list(model.model_fields)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def config_reference_markdown() -> str:
    """A Markdown table of every field (dotted name, type, default, description) in declaration order,
    each section's row before its fields. The README's config reference is this output, so it depends on
    the models only (not on the environment)."""
    rows = ["| Field | Type | Default | Description |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {cell} |" for name, cell in _reference_rows(ArcticRLClientConfig, "")]
    return "\n".join(rows) + "\n"


def _reference_rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str]]:
    """``(dotted name, "type | default | description")`` of ``model``'s fields, sections recursively."""
    rows = []
    for name, info in model.model_fields.items():
        section = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, _Section) else None
        if section is not None:
            default = "section"
        elif info.is_required():
            default = "required"
        else:
            default = f"`{json.dumps(info.get_default(call_default_factory=True))}`"
        kind = f"`{_type_text(info.annotation)}`" + "".join(f", {bound}" for bound in _bounds_text(info.metadata))
        rows.append((prefix + name, " | ".join(cell.replace("|", "\\|") for cell in (kind, default, info.description or ""))))
        if section is not None:
            rows += _reference_rows(section, f"{prefix}{name}.")
    return rows


def _type_text(annotation: Any) -> str:
    """``str | None``, ``"local" | "http"``, ``dict[str, Any]``: a type as a config file sees it."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(arg) for arg in args)
    if origin in (Union, UnionType):
        return " | ".join(_type_text(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_text(arg) for arg in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "Any"
    return annotation.__name__


def _bounds_text(metadata: list[Any]) -> list[str]:
    """``>= 1``, ``> 0``, ``non-empty``: a field's constraints."""
    texts = []
    for item in metadata:
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                texts.append(f"{symbol} {getattr(item, attr)}")
        if isinstance(item, annotated_types.MinLen):
            texts.append("non-empty")
    return texts
