"""Running ``arctic-rl fit`` as Ray Train workers: the config's ``ray`` section (``num_workers > 0``)
turns the command into a Ray Train driver whose workers each build the same LightningCLI and fit,
with Ray's Lightning environment giving ranks (Ray Train's Lightning integration, no home-made
launcher). Rollout engines come from ``RolloutCallback(ray=...)`` and are shared by all workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from arctic_rl.config_paths import config_text
from arctic_rl.errors import ConfigError
from arctic_rl.ray_address import init_address

WORKER_ENV = "ARCTIC_RL_RAY_TRAIN_WORKER"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement-group strategies


@dataclass
class RayTrainConfig:
    """The YAML's top-level ``ray`` section.

    Args:
        address: cluster to join (``auto`` after ``ray start`` on each node); None: ``$RAY_ADDRESS``, else a local cluster.
        num_workers: training processes (0: train in this process, no Ray Train).
        use_gpu: give each worker a GPU share (``gpus_per_worker``).
        gpus_per_worker: GPUs per worker; below 1 leaves room for colocated engines on the same GPU.
        cpus_per_worker: Ray CPUs per worker.
        backend: torch.distributed backend of the workers (None: nccl with GPUs, else gloo).
        storage_path: where Ray Train keeps its run directory (default: ``./ray_results``).
        placement_strategy: how the workers' placement group lays them over the nodes: ``PACK`` (fill a node
            first), ``SPREAD`` (one per node where possible), ``STRICT_PACK`` or ``STRICT_SPREAD``. With several
            nodes, each worker's Lightning ``num_nodes``/``devices`` follow where Ray put them.
    """

    address: str | None = None
    num_workers: int = 0
    use_gpu: bool = False
    gpus_per_worker: float = 1.0
    cpus_per_worker: float = 1.0
    backend: str | None = None
    storage_path: str | None = None
    placement_strategy: str = "PACK"


def ray_section(argv: list[str]) -> RayTrainConfig:
    """The ``ray`` section from the ``--config`` files and ``--ray.*`` overrides, without building the CLI."""
    import yaml

    values: dict = {}
    for i, arg in enumerate(argv[:-1]):
        if arg == "--config":
            values.update((yaml.safe_load(config_text(argv[i + 1])) or {}).get("ray") or {})
    names = {f.name: f.type for f in fields(RayTrainConfig)}
    for i, arg in enumerate(argv[:-1]):
        if arg.startswith("--ray.") and arg[len("--ray.") :] in names:
            values[arg[len("--ray.") :]] = yaml.safe_load(argv[i + 1])
    unknown = set(values) - set(names)
    if unknown:
        raise ConfigError(f"ray: unknown keys {sorted(unknown)}; known: {sorted(names)}")
    for name, value in values.items():
        _check_type(f"ray.{name}", value, names[name])
    if values.get("placement_strategy", "PACK") not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"ray.placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {values['placement_strategy']!r}")
    return RayTrainConfig(**values)


def _check_type(field: str, value: object, annotation: str) -> None:
    """``value`` against a ``RayTrainConfig`` annotation such as ``"int"`` or ``"str | None"``."""
    kinds = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),)}
    names = [t.strip() for t in annotation.split("|")]
    allowed = tuple(k for t in names for k in kinds[t])
    if not isinstance(value, allowed) or (isinstance(value, bool) and "bool" not in names):
        raise ConfigError(f"{field} must be {' or '.join(names)}, got {value!r}")


def is_ray_train_worker() -> bool:
    return os.environ.get(WORKER_ENV) == "1"


def _worker_loop(config: dict) -> None:
    os.environ[WORKER_ENV] = "1"
    os.chdir(config["cwd"])  # relative paths in the config mean what they meant to the user
    sys.path[:0] = [d for d in config.get("import_dirs", ()) if d not in sys.path]  # task modules beside the config
    config["run_cli"](config["argv"])


def launch(argv: list[str], cfg: RayTrainConfig, run_cli: Callable[[list[str]], object], import_dirs: list[str] = ()) -> None:
    """Run ``run_cli(argv)`` (the CLI's ``build_cli``, passed in so this module needs no import of the
    CLI) on ``cfg.num_workers`` Ray Train workers and wait for it; ``import_dirs`` go first on each
    worker's ``sys.path`` (the config files' directories, for task modules beside them)."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    started = not ray.is_initialized()
    if started:
        ray.init(address=init_address(cfg.address), include_dashboard=False, log_to_driver=True)
    try:
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={"argv": argv, "cwd": os.getcwd(), "run_cli": run_cli, "import_dirs": list(import_dirs)},
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                         resources_per_worker={"CPU": cfg.cpus_per_worker,
                                                               **({"GPU": cfg.gpus_per_worker} if cfg.use_gpu else {})},
                                         placement_strategy=cfg.placement_strategy),
            torch_config=TorchConfig(backend=cfg.backend or ("nccl" if cfg.use_gpu else "gloo")),
            run_config=RunConfig(storage_path=str(Path(cfg.storage_path or "ray_results").resolve()), name="arctic-rl"),
        )
        result = trainer.fit()
        if result.error is not None:
            raise result.error
    finally:
        if started:
            ray.shutdown()


def ray_trainer_overrides(config: dict) -> dict:
    """Inside a Ray Train worker: ranks from Ray's Lightning environment, one device per worker."""
    from ray.train.lightning import RayLightningEnvironment

    from arctic_rl.strategies import ArcticStrategy

    strategy = config.get("strategy", "auto")
    if not isinstance(strategy, ArcticStrategy):
        # GRPOModule takes several backward passes and optimizer steps per training_step, which DDP's
        # reducer (one backward per forward) cannot follow; DeepSpeed's engine can
        raise ValueError(
            f"ray.num_workers > 0 needs trainer.strategy: arctic_rl.strategies.ArcticStrategy (got {strategy!r})"
        )
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    strategy.use_ray_train_worker(RayLightningEnvironment(), ray.train.torch.get_device())
    local = context.get_local_world_size()
    return {**config, "devices": local, "num_nodes": context.get_world_size() // local}
