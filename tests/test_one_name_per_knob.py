"""One name per knob: every option that ``arctic-rl fit`` (``GRPOModule``'s sections, ``model.init_args.<section>.<field>``;
the rollout engines of ``RolloutCallback`` and its ``RayEngines``) and the service (``ArcticRLClientConfig``) both take has
the same dotted name and the same default in both schemas."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from pydantic import BaseModel

from arctic_rl.modules.grpo import GRPOModule
from arctic_rl.modules.options import SECTIONS
from arctic_rl.rollout.callback import RayEngines, RolloutCallback
from arctic_rl.cluster.launch import RayTrainConfig
from arctic_rl.serve.config import OLD_KEYS, ArcticRLClientConfig


def module_knobs() -> dict[str, Any]:
    """``{dotted name: default}`` of GRPOModule's options: its plain arguments and each section's fields."""
    knobs = {name: p.default for name, p in inspect.signature(GRPOModule.__init__).parameters.items()
             if name not in ("self", *SECTIONS) and p.kind is p.POSITIONAL_OR_KEYWORD}
    for section, cls in SECTIONS.items():
        default = cls()
        knobs.update({f"{section}.{f.name}": getattr(default, f.name) for f in dataclasses.fields(cls)})
    return knobs


def engine_knobs() -> dict[str, Any]:
    """``{engines.<name>: default}`` of fit's rollout engines: ``RolloutCallback``'s ``engine`` and ``engine_kwargs``
    (None: no extra arguments, ``{}``), and the fields of its ``ray`` (:class:`RayEngines`)."""
    callback = inspect.signature(RolloutCallback.__init__).parameters
    knobs = {"engines.engine": callback["engine"].default, "engines.engine_kwargs": callback["engine_kwargs"].default or {}}
    default = RayEngines()
    knobs.update({f"engines.{f.name}": getattr(default, f.name) for f in dataclasses.fields(RayEngines)})
    return knobs


def ray_knobs() -> dict[str, Any]:
    """``{ray.<name>: default}`` of fit's top-level ``ray`` section (:class:`RayTrainConfig`), and RayEngines'
    ``placement_strategy``, which the service's rank placement group takes too."""
    default = RayTrainConfig()
    return {**{f"ray.{f.name}": getattr(default, f.name) for f in dataclasses.fields(RayTrainConfig)},
            "ray.placement_strategy": RayEngines().placement_strategy}


# fit's workers ask for a GPU through use_gpu (then gpus_per_worker, default 1); the service has no use_gpu, so its
# gpus_per_worker defaults to 0 (CPU ranks) and is the one knob
DIFFERENT_DEFAULTS = {"ray.gpus_per_worker"}

# fit colocates by placement (num_gpus_per_engine < 1 beside training), and runs its engines as Ray actors when its
# RolloutCallback has a ray (RayEngines) section: the service says both with a knob of its own
SERVICE_ONLY_ENGINE_KNOBS = {"engines.colocated", "engines.launcher"}


def client_knobs(model: type[BaseModel] = ArcticRLClientConfig, prefix: str = "") -> dict[str, Any]:
    """``{dotted name: default}`` of the client config's leaves, through its sections and the option dataclasses it composes."""
    knobs: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            knobs.update(client_knobs(kind, f"{prefix}{name}."))
        elif dataclasses.is_dataclass(kind):
            default = kind()
            knobs.update({f"{prefix}{name}.{f.name}": getattr(default, f.name) for f in dataclasses.fields(kind)})
        else:
            knobs[prefix + name] = None if info.is_required() else info.get_default(call_default_factory=True)
    return knobs


def test_every_knob_of_both_front_doors_has_one_name_and_one_default():
    module, client = module_knobs(), client_knobs()
    by_leaf = {name.rpartition(".")[2]: name for name in module}  # a field's name is unique over the sections
    assert len(by_leaf) == len(module)
    shared = {name: by_leaf[name.rpartition(".")[2]] for name in client if name.rpartition(".")[2] in by_leaf}
    assert {client_name: module_name for client_name, module_name in shared.items() if client_name != module_name} == {}
    assert {name: (client[name], module[name]) for name in shared if client[name] != module[name] and name != "model"} == {}
    # the knobs both take, by their one name (the client's sections compose fit's classes, whole)
    assert {"model", "tokenizer", "dtype", "optim.learning_rate", "compute.zorro", "compute.zorro_dedup", "lora.rank",
            "sampling.seed", "sampling.temperature", "sampling.max_response_length"} <= set(shared)
    for section in ("optim", "compute", "lora"):
        assert ArcticRLClientConfig.model_fields[section].annotation is SECTIONS[section]


def test_every_engine_knob_of_the_service_is_fits_by_name_and_default():
    fit, client = engine_knobs(), client_knobs()
    service = {name: default for name, default in client.items() if name.startswith("engines.")}
    assert sorted(set(service) - set(fit) - SERVICE_ONLY_ENGINE_KNOBS) == []  # a new engine knob takes fit's name
    assert {name: (service[name], fit[name]) for name in service if name in fit and service[name] != fit[name]} == {}
    assert {"engines.engine", "engines.engine_kwargs", "engines.num_engines", "engines.num_gpus_per_engine",
            "engines.num_cpus_per_engine"} <= set(service) & set(fit)
    assert not {name for name in client if name.startswith("sampling.")} - set(module_knobs())  # sampling: fit's fields only


def test_the_services_ray_knobs_are_fits_by_name_and_default():
    fit, client = ray_knobs(), client_knobs()
    service = {name: default for name, default in client.items() if name.startswith("ray.")}
    assert sorted(set(service) - set(fit)) == []
    assert {name: (service[name], fit[name]) for name in service
            if service[name] != fit[name] and name not in DIFFERENT_DEFAULTS} == {}
    assert {"ray.address", "ray.placement_strategy", "ray.cpus_per_worker", "ray.gpus_per_worker"} <= set(service)


def test_the_old_client_keys_each_name_a_knob_of_both_and_are_gone_from_the_schema():
    fit = {*module_knobs(), *engine_knobs(), *ray_knobs(), *SERVICE_ONLY_ENGINE_KNOBS}  # colocated: the service's own
    client = client_knobs()  # colocated: the service's own
    assert sorted(new for new in OLD_KEYS.values() if new not in fit or new not in client) == []
    assert sorted(old for old in OLD_KEYS if old in client) == []
    assert {old for old in OLD_KEYS if old.startswith("sampling.")} == {f"sampling.{name}" for name in (
        "engine", "num_engines", "gpus_per_engine", "cpus_per_engine", "colocated", "engine_kwargs")}  # the engines' old home
