"""``ArcticRLClientConfig``: what an ``ArcticRLClient`` starts (model, training, rollout engines, server)
and how it reaches it, validated once by ``ArcticRLClientConfig.load`` into a frozen pydantic model.

``load`` is the front door: it reads a dict, a YAML file or an existing config, merges keyword
overrides into it, and turns every validation error into one ``ConfigError`` listing each bad field by
its dotted path.

The options it shares with ``arctic-rl fit`` are ``GRPOModule``'s own sections (``modules/options.py``), composed
here under the same names: ``optim`` (:class:`OptimOptions`), ``compute`` (:class:`ComputeOptions`), ``lora``
(:class:`LoraOptions`), and ``sampling``'s lengths, temperature and seed; their defaults and rules are the
dataclasses'. ``engines`` names its knobs as fit's ``RolloutCallback`` and ``RayEngines`` do. The keys of the last
release (``training.learning_rate``, ``sampling.gpus_per_engine``, ``seed``, ...) load with one warning naming the new
key (:data:`OLD_KEYS`); one option given under both is an error naming both.
``config_reference.py`` renders the config reference of docs/configuration.md from the models.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import ErrorDetails, PydanticCustomError

from arctic_rl.errors import ConfigError
from arctic_rl.modules.flat_options import move_old_keys
from arctic_rl.rollout.engines.kinds import EngineChoice
from arctic_rl.options import ComputeOptions, LoraOptions, OptimOptions, SamplingOptions
from arctic_rl.serve.security import DEFAULT_MAX_REQUEST_MB, is_loopback

TOKEN_ENV = "ARCTIC_RL_TOKEN"
REDACTED = "<redacted>"  # what ``to_dict()`` writes instead of the token
# Lightning's precision strings (lightning.fabric.plugins.precision.precision._PRECISION_INPUT_STR)
_SAMPLING = SamplingOptions()
SHARED_SECTIONS = ("sampling", "optim", "compute", "lora")  # named as in fit (model.<section>.<field>)
PRECISIONS = ("32-true", "64-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed",
              "transformer-engine", "transformer-engine-float16")


def _inconsistent(field: str, reason: str) -> PydanticCustomError:
    """A cross-field error; ``field`` is the path (relative to the model raising it) the message names."""
    return PydanticCustomError("inconsistent", "{field}: {reason}", {"field": field, "reason": reason})


class _Section(BaseModel):
    """Base of every config model: unknown fields, NaN and infinity are errors; validated once, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TrainingConfig(_Section):
    """Where and how the service's training processes run: devices, DeepSpeed, precision, the schedule's length.
    The optimizer is ``optim``, the micro-batching ``compute``."""

    accelerator: Literal["auto", "cpu", "gpu"] = Field("auto", description="Lightning accelerator of the training processes.")
    devices: int = Field(1, ge=1, description="Training ranks (DeepSpeed) per node, one per device; more than 1 rank in all "
                                              "needs zero_stage >= 1 (gloo on CPU, nccl on GPU).")
    num_nodes: int = Field(1, ge=1, description="Nodes; the job has devices x num_nodes ranks. More than 1 needs launcher ray.")
    launcher: Literal["processes", "ray"] = Field(
        "processes", description="How the ranks start: processes: local rank processes on this machine (no Ray); ray: one "
                                 "Ray actor per rank on the cluster at ray.address, placed by ray.placement_strategy.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="0: plain torch, no DeepSpeed; 1-3: ArcticStrategy (DeepSpeed ZeRO stage).")
    deepspeed_config: dict[str, Any] | None = Field(
        None, description="Raw DeepSpeed config keys merged over the typed ones (passthrough); needs zero_stage >= 1.")
    offload_optimizer: bool = Field(False, description="ZeRO: keep optimizer states in CPU memory; needs zero_stage >= 1.")
    precision: str = Field("32-true", description=f"Lightning precision, one of {', '.join(PRECISIONS)}.")
    total_steps: int | None = Field(None, ge=1, description="Schedule length in optimizer steps; required for linear and cosine optim.lr_schedule.")
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
        if self.zero_stage == 0 and self.deepspeed_config is not None:
            raise _inconsistent("deepspeed_config", "needs zero_stage 1, 2 or 3 (zero_stage 0 runs without DeepSpeed)")
        if self.zero_stage == 0 and self.offload_optimizer:
            raise _inconsistent("offload_optimizer", "needs zero_stage 1, 2 or 3 (offloading is a DeepSpeed ZeRO feature)")
        if self.num_nodes > 1 and self.launcher != "ray":
            raise _inconsistent("num_nodes", f"{self.num_nodes} nodes need launcher: ray (rank actors placed on a Ray cluster); "
                                            "launcher processes starts its ranks on this machine only")
        if self.world_size > 1 and self.zero_stage == 0:
            raise _inconsistent("zero_stage", f"{self.ranks_text} needs zero_stage 1, 2 or 3: several backward passes "
                                             "per step, which DeepSpeed's engine reduces over ranks (as arctic-rl fit requires)")
        raw_stage = (self.deepspeed_config or {}).get("zero_optimization", {}).get("stage", self.zero_stage)
        if raw_stage != self.zero_stage:
            raise _inconsistent("deepspeed_config",
                               f"zero_optimization.stage={raw_stage!r} contradicts zero_stage={self.zero_stage}")
        return self

    @property
    def world_size(self) -> int:
        """The job's training ranks: ``devices x num_nodes``."""
        return self.devices * self.num_nodes

    @property
    def ranks_text(self) -> str:
        """The ranks as the config sets them, for messages: ``devices=2`` or ``devices=1 x num_nodes=2``."""
        return f"devices={self.devices}" + (f" x num_nodes={self.num_nodes}" if self.num_nodes > 1 else "")


class RayConfig(_Section):
    """The Ray cluster of ``protocol: ray`` (the service actor) and of ``training.launcher: ray`` (a rank actor per
    device); named as fit's ``ray`` section and ``RayEngines`` name them."""

    address: str | None = Field(
        None, description='The cluster to join: "auto" (the one ray start made on this machine), "host:port" or '
                          '"ray://host:port"; null: the Ray this process runs, else $RAY_ADDRESS, else a local one '
                          'started here.')
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="launcher ray: how the placement group of one bundle per rank lays the ranks over the nodes "
                            "(PACK: as few nodes as fit; SPREAD: over as many as it can).")
    cpus_per_worker: float = Field(1.0, gt=0, description="launcher ray: Ray CPUs per training rank.")
    gpus_per_worker: float = Field(0.0, ge=0, description="launcher ray: GPUs per training rank: 1 with training.accelerator "
                                                          "gpu, 0 on CPU.")


class EnginesConfig(_Section):
    """The rollout engines: which, how many, and their resources; named as ``arctic-rl fit`` names them
    (``RolloutCallback``'s ``engine`` and ``engine_kwargs``, :class:`RayEngines`' ``num_*``)."""

    engine: EngineChoice = Field("auto", description="Rollout engine; auto: vLLM when installed, else transformers.")
    num_engines: int = Field(1, ge=1, description="Engine replicas (fit's RayEngines.num_engines); a sample request's prompts are "
                                                  "spread over them, each prompt's samples on one replica.")
    launcher: Literal["auto", "in_process", "ray"] = Field(
        "auto", description="Where the engines run: in_process: one engine inside training rank 0's process; ray: num_engines "
                            "Ray actors of their own, beside the ranks, on the cluster at ray.address and placed by "
                            "ray.placement_strategy (any number of ranks, vLLM included); auto: ray when num_engines > 1.")
    num_gpus_per_engine: float = Field(0.0, ge=0, description="GPUs per engine (Ray resource); a fraction below 1 shares a GPU; above 1, a whole number.")
    num_cpus_per_engine: float = Field(1.0, gt=0, description="CPUs per engine (Ray resource).")
    colocated: bool = Field(False, description="Engines share the training ranks' resources and sleep while training runs. With "
                                               "training.launcher ray, replica i goes into rank i's placement bundle (on CPU "
                                               "too; needs engines.launcher ray, num_engines <= ranks); otherwise they share "
                                               "the training GPUs through a fraction 0 < num_gpus_per_engine < 1.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the engine's constructor (for vLLM: its engine arguments).")

    @property
    def on_ray(self) -> bool:
        """Whether the engines run as Ray actors (``launcher``; ``auto``: when there are several)."""
        return self.launcher == "ray" or (self.launcher == "auto" and self.num_engines > 1)

    @model_validator(mode="after")
    def _consistent(self) -> EnginesConfig:
        if self.launcher == "in_process" and self.num_engines > 1:
            raise _inconsistent("num_engines", f"{self.num_engines} engines cannot all live in one process: set launcher: "
                                               "ray (or auto) to run them as Ray actors")
        gpus = self.num_gpus_per_engine
        if self.colocated and gpus >= 1:
            raise _inconsistent("num_gpus_per_engine", f"colocated engines share a GPU with training: need a fraction in (0, 1), got {gpus}")
        if gpus > 1 and not gpus.is_integer():
            raise _inconsistent("num_gpus_per_engine", f"above 1 it must be a whole number (Ray's rule), got {gpus}")
        return self


class SamplingConfig(_Section):
    """What the engines sample: fit's ``model.sampling`` (:class:`SamplingOptions`' defaults) less ``group_size`` and ``top_p`` (requests')."""

    max_prompt_length: int = Field(_SAMPLING.max_prompt_length, ge=1, description="Longest prompt in tokens.")
    max_response_length: int = Field(_SAMPLING.max_response_length, ge=1, description="Most tokens sampled per response.")
    temperature: float = Field(
        _SAMPLING.temperature, gt=0, description="Sampling temperature, also the one log-probs are computed at (on-policy ratios need both equal).")
    seed: int = Field(_SAMPLING.seed, ge=0, description="Seed of initialisation, sampling and data order.")


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

    Engines as Ray actors (``engines.launcher: ray``, or ``num_engines > 1``) work with every protocol, ``local`` included,
    and any number of training ranks: they run beside the core or its ranks, in processes of their own."""

    protocol: Literal["local", "http", "ray"] = Field(
        "local", description="How the client reaches the core: in-process, over HTTP, or as a Ray actor.")
    server_url: str | None = Field(
        None, description="protocol http: the server, http://host:port; null: the client starts an embedded server.")
    auth_token: str | None = Field(
        None, min_length=1, repr=False,
        description=f"Bearer token of the HTTP server; when the field is absent, ${TOKEN_ENV}. Never shown in repr or to_dict().")
    model: str | dict[str, Any] | None = Field(
        description="A save_pretrained folder or hub id, or a transformers config dict with model_type (random init). "
                    "With protocol http and a server_url it may be left out (the server's); given, it must be the server's.")
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; null: the model's. Required when model is a dict.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Dtype of the model weights.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Training (section).")
    engines: EnginesConfig = Field(default_factory=EnginesConfig, description="Rollout engines (section).")
    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Lengths, temperature and seed the engines sample at (section; fit's model.sampling).")
    optim: OptimOptions = Field(default_factory=OptimOptions, description="The optimizer and its schedule (section; fit's model.optim).")
    compute: ComputeOptions = Field(
        default_factory=ComputeOptions, description="How a step is computed: micro-batches, ZoRRo, kernels (section; fit's model.compute).")
    lora: LoraOptions = Field(default_factory=LoraOptions, description="LoRA adapters through peft (section; fit's model.lora).")
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster of protocol ray and training.launcher ray (section; fit's ray).")
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig, description="Client-side timeouts (section).")
    server: ServerConfig = Field(default_factory=ServerConfig, description="HTTP server (section).")

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        """The keys of the last release moved to their new place, one warning each (:data:`OLD_KEYS`)."""
        if not isinstance(data, dict):
            return data
        try:
            return move_old_keys(data, OLD_KEYS)
        except ConfigError as e:  # one option under both names
            raise PydanticCustomError("twice", "{message}", {"message": str(e)}) from None

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
        if self.ray.address is not None and self.protocol != "ray" and self.training.launcher != "ray" and not self.engines.on_ray:
            raise _inconsistent("ray.address", f"only used with protocol 'ray', training.launcher 'ray' or engines on Ray, but "
                                               f"protocol is {self.protocol!r}, training.launcher {self.training.launcher!r} and "
                                               f"the engines run in process")
        gpus, accelerator = self.ray.gpus_per_worker, self.training.accelerator
        if self.training.launcher == "ray" and (accelerator, gpus > 0) in (("gpu", False), ("cpu", True)):
            raise _inconsistent("ray.gpus_per_worker", f"{gpus:g} with training.accelerator {accelerator!r}: give each "
                                                       "rank 1 GPU with accelerator gpu, none with cpu")
        remote = urlsplit(self.server_url).hostname if self.server_url else None
        if remote is not None and not is_loopback(remote) and self.auth_token is None:
            raise _inconsistent("auth_token", f"required for the non-loopback server {remote!r} (or set {TOKEN_ENV})")
        if not is_loopback(self.server.host) and self.auth_token is None:
            raise _inconsistent("server.host", f"refusing to listen on {self.server.host or '<all interfaces>'} "
                                              f"without an auth token: set auth_token or {TOKEN_ENV}")
        if self.training.world_size > 1 and self.engines.engine != "transformers" and not self.engines.on_ray:
            raise _inconsistent("engines.engine", f"{self.engines.engine!r} with training.{self.training.ranks_text} needs "
                                                 "engines.launcher: ray (the engines as Ray actors beside the ranks), or engine "
                                                 "'transformers': an in-process vLLM engine on rank 0 joins the ranks' process "
                                                 "group at start and waits for the other ranks forever")
        if self.optim.lr_schedule != "constant" and self.training.total_steps is None:
            raise _inconsistent("training.total_steps", f"required with optim.lr_schedule {self.optim.lr_schedule!r} (the schedule's length)")
        if self.training.total_steps is not None and self.optim.warmup_steps > self.training.total_steps:
            raise _inconsistent("optim.warmup_steps", f"{self.optim.warmup_steps} is more than training.total_steps={self.training.total_steps}")
        if (self.optim.mini_batches, self.optim.num_iterations) != (1, 1):
            raise _inconsistent("optim.mini_batches", "and optim.num_iterations shape arctic-rl fit's steps over a rollout batch; the"
                                                      " service takes one optimizer step per optim_step request: leave both 1")
        if self.lora.rank and self.training.zero_stage == 3:
            raise _inconsistent("lora.rank", f"{self.lora.rank} needs training.zero_stage 0, 1 or 2, not 3 (peft cannot "
                                             "wrap ZeRO-3's partitioned parameters)")
        if self.engines.colocated:
            self._check_colocated()
        return self

    @property
    def replicas_in_rank_bundles(self) -> bool:
        """Colocated engine replicas that start in the rank actors' placement bundles (``training.launcher: ray``)."""
        return self.engines.colocated and self.engines.on_ray and self.training.launcher == "ray"

    def _check_colocated(self) -> None:
        e, t = self.engines, self.training
        if t.launcher != "ray":  # the engines share the ranks' GPUs through fractional Ray GPUs
            if t.accelerator == "cpu":
                raise _inconsistent("engines.colocated", "engines can only share training GPUs, but training.accelerator is "
                                                         "'cpu' (on CPU, set training.launcher: ray: each replica then shares "
                                                         "a training rank's placement bundle)")
            if not 0 < e.num_gpus_per_engine < 1:
                raise _inconsistent("engines.num_gpus_per_engine", f"colocated engines share a GPU with training: need a "
                                                                   f"fraction in (0, 1), got {e.num_gpus_per_engine:g}")
            return
        if not e.on_ray:
            raise _inconsistent("engines.launcher", f"{e.launcher!r} with colocated and training.launcher ray: the replicas "
                                                    "are Ray actors in the ranks' placement bundles; set engines.launcher: ray")
        if e.num_engines > t.world_size:
            raise _inconsistent("engines.num_engines", f"{e.num_engines} colocated replicas for {t.world_size} training ranks: "
                                                       "each replica shares one rank's bundle, so at most one per rank")
        if self.ray.gpus_per_worker + e.num_gpus_per_engine > 1:
            raise _inconsistent("engines.num_gpus_per_engine", f"{e.num_gpus_per_engine:g} beside ray.gpus_per_worker="
                                                               f"{self.ray.gpus_per_worker:g}: a rank and its colocated replica "
                                                               "share one GPU, so together at most 1")

    def module_options(self) -> dict[str, Any]:
        """``GRPOModule``'s option sections this config sets: ``optim``, ``compute`` and ``lora`` as they are, and
        ``sampling`` without a ``group_size`` (requests carry their own groups); the others at their defaults."""
        sampling = SamplingOptions(group_size=None, **self.sampling.model_dump())
        return {"sampling": sampling, "optim": self.optim, "compute": self.compute, "lora": self.lora}

    @classmethod
    def load(cls, source: ConfigSource = None, **overrides: Any) -> ArcticRLClientConfig:
        """Validate ``source`` with ``overrides`` merged in.

        Args:
            source: a dict of fields, a YAML file's path, an existing config, or None (fields from
                ``overrides`` only).
            **overrides: top-level fields; a section's fields as a dict, merged recursively into the
                source's (``optim={"learning_rate": 1e-5}`` keeps the other optim fields). Dicts
                _merge into dict-valued fields too (``engine_kwargs``, a config-dict ``model``).

        Raises:
            ConfigError: the file cannot be read, or any field is invalid; the message lists every bad
                field by dotted path (``engines.num_engines: ...``), unknown ones with the known fields.
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
    if detail["type"] in ("extra_forbidden", "unexpected_keyword_argument"):  # the latter: an option dataclass's
        return f"{path}: unknown field; known fields here: {', '.join(_fields_at(detail['loc'][:-1]))}"
    if detail["type"] == "missing":
        return f"{path}: {detail['msg']}"
    if detail["type"] == "twice":
        return ctx["message"]
    if detail["type"] == "value_error" and ctx.get("error") is not None:  # a section's own check (modules/options.py)
        message = str(ctx["error"])
        for section in SHARED_SECTIONS:  # they name fit's model.<section>.<field>: the same name less fit's root
            message = message.replace(f"model.{section}.", f"{section}.")
        return message if message.startswith(f"{path}.") else f"{path}: {message}"
    shown = REDACTED if loc[-1:] == ["auth_token"] else _short_repr(detail["input"])
    return f"{path}: {detail['msg']} (got {shown})"


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the section at ``loc`` (a path of section names from the top)."""
    model: Any = ArcticRLClientConfig
    for part in loc:
        model = model.model_fields[str(part)].annotation  # sections only
    return [f.name for f in fields(model)] if is_dataclass(model) else list(model.model_fields)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The client keys of the last release -> their place now (the options fit and the service share).
OLD_KEYS: dict[str, str] = {
    **{f"training.{name}": f"optim.{name}" for name in ("learning_rate", "lr_schedule", "warmup_steps", "min_lr_ratio",
                                                        "num_cycles", "weight_decay", "max_grad_norm")},
    **{f"training.{name}": f"compute.{name}" for name in ("micro_batch_size", "micro_batch_tokens", "gradient_checkpointing")},
    "zorro.enabled": "compute.zorro", "zorro.attention_backend": "compute.attention_backend",
    "zorro.self_check": "compute.self_check", "zorro.dedup": "compute.zorro_dedup", "seed": "sampling.seed",
    **{f"sampling.{name}": f"engines.{name}" for name in ("engine", "num_engines", "colocated", "engine_kwargs")},
    "sampling.gpus_per_engine": "engines.num_gpus_per_engine", "sampling.cpus_per_engine": "engines.num_cpus_per_engine",
    "ray_address": "ray.address",
}
