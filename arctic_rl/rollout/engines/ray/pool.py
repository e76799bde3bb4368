"""``EnginePool``: N rollout-engine actors (replicas) on a Ray cluster, placed with a placement group, and the
rule that spreads a rollout batch over them: every prompt's samples on one replica, the replicas' tokens balanced.

A replica whose actor dies (its process killed, its node lost) fails the call that was waiting on it with
:class:`ReplicaFailed`, naming the replica, its actor and its node; nothing waits on it.

The pool is what the rollout stream asks of an in-process engine: it ``UpdatesInFlight`` (each replica takes a sync
while it decodes, on a thread of its own: ``actor.py``) and ``StopsAtDeadline`` (the deadline travels with each
``generate`` call as a wall-clock time, so it means the same moment on every node, up to their clocks' skew)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from arctic_rl.ray_address import init_address
from arctic_rl.rollout.engines.ray.actor import CONCURRENCY_GROUPS, ENGINE_ENV, METHOD_GROUPS, EngineActor
from arctic_rl.rollout.engines.base import Completion, SamplingConfig
from arctic_rl.rollout.engines.seeds import resolve_prompt_seeds


def balance_prompts(prompt_lengths: list[int], samples_per_prompt: int, max_new_tokens: int, num_engines: int) -> list[list[int]]:
    """Assign prompt indices to engines so each gets about the same number of tokens to process.

    Every prompt's G samples stay on one engine (its prefix cache then serves them). Greedy
    longest-first: each prompt (cost ``len + G x max_new_tokens``, in index order among equals) goes to
    the least-loaded engine. Returns, per engine, its prompt indices in ascending order."""
    cost = [length + samples_per_prompt * max_new_tokens for length in prompt_lengths]
    loads, assignment = [0] * num_engines, [[] for _ in range(num_engines)]
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        target = min(range(num_engines), key=lambda e: (loads[e], e))
        assignment[target].append(i)
        loads[target] += cost[i]
    return [sorted(a) for a in assignment]


NAMESPACE = "arctic-rl"  # the Ray namespace of the replicas' names, which other training ranks look them up by


class ReplicaFailed(RuntimeError):
    """An engine replica of a pool died (its process killed, its node lost); the message names it (index, actor, node)."""


class EnginePool:
    """Starts ``num_engines`` :class:`EngineActor` s, each with ``num_cpus``/``num_gpus`` in one bundle
    of a placement group (``PACK``: colocated where possible; ``SPREAD``: over nodes).

    Args:
        kind, model_path, dtype, max_model_len, seed, device, engine_kwargs: as for ``make_engine``.
        num_engines: engine actors.
        num_cpus, num_gpus: resources per engine (fractional GPUs share a device with training).
        placement_strategy: Ray placement-group strategy.
        max_restarts: Ray restarts of a dead engine actor (0: a dead engine is an error naming it).
        placement_timeout_s: how long to wait for the cluster to have the resources.
        ship_model_files: send the files of ``model_path`` (a small local directory) to the engines
            through Ray instead of having them read the path (for engines on other nodes).
        shared_bundles: ``(placement group, bundle indices)``: start engine i in the given bundle of a placement group
            another owner made and sized for it (colocated with training ranks), instead of in a group of the pool's
            own; ``placement_strategy`` is then the group's, and shutdown leaves the group to its owner.
    """

    def __init__(self, kind: str, model_path: str, *, num_engines: int = 1, dtype: str = "auto", max_model_len: int = 2048,
                 seed: int = 0, device: str = "cpu", engine_kwargs: dict[str, Any] | None = None, num_cpus: float = 1,
                 num_gpus: float = 0, placement_strategy: str = "PACK", max_restarts: int = 0,
                 placement_timeout_s: float = 300.0, ship_model_files: bool = False,
                 shared_bundles: tuple[Any, Sequence[int]] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if shared_bundles is not None:
            group, indices = shared_bundles[0], list(shared_bundles[1])
            if len(indices) != num_engines:
                raise ValueError(f"{num_engines} engines need {num_engines} shared bundles, got {len(indices)}")
            self.placement_group, self._owns_group = group, False
        else:
            bundles = [{"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})} for _ in range(num_engines)]
            self.placement_group, self._owns_group, indices = placement_group(bundles, strategy=placement_strategy), True, list(range(num_engines))
            try:
                ray.get(self.placement_group.ready(), timeout=placement_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(self.placement_group)
                raise RuntimeError(
                    f"could not place {num_engines} engines of {bundles[0]} ({placement_strategy}) within {placement_timeout_s:.0f}s;"
                    f" the cluster has {ray.available_resources()} available"
                ) from None
        model_files = None
        if ship_model_files:
            root = Path(model_path)
            model_files = {f.name: f.read_bytes() for f in root.iterdir() if f.is_file()}
        self.owner, self.places, self.failed = True, [], False  # failed: a replica died (see shutdown)
        self.deadline: float | None = None  # ``stop_at``: this process's ``time.monotonic()``
        prefix = f"arctic-rl-engine-{uuid.uuid4().hex[:12]}"
        self.names = [f"{prefix}-{i}" for i in range(num_engines)]
        actor_cls = _actor_class()
        self.actors = [
            actor_cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                max_restarts=max_restarts,
                runtime_env={"env_vars": ENGINE_ENV},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle),
                name=name,
                namespace=NAMESPACE,
            ).remote(kind, model_path, dtype=dtype, max_model_len=max_model_len, seed=seed + i, device=device,
                     engine_kwargs=engine_kwargs, model_files=model_files)
            for i, (name, bundle) in enumerate(zip(self.names, indices))
        ]
        try:
            self.places = self._get_each([a.describe.remote() for a in self.actors], "start")
        except ReplicaFailed:
            self.shutdown()
            raise

    @classmethod
    def attach(cls, names: list[str]) -> "EnginePool":
        """A pool over the replicas another process started, found by their names (its shutdown leaves them running)."""
        import ray

        pool = cls.__new__(cls)
        pool.names, pool.owner, pool.placement_group, pool.places, pool.failed = list(names), False, None, [], False
        pool._owns_group, pool.deadline = False, None
        pool.actors = [ray.get_actor(name, namespace=NAMESPACE) for name in names]
        pool.places = pool._get_each([a.describe.remote() for a in pool.actors], "report its node")
        return pool

    def replica_name(self, i: int) -> str:
        """Replica ``i`` for a message: its index, actor name and, once known, its node."""
        place = f" on node {self.places[i]['ip']} ({self.places[i]['node_id'][:12]})" if i < len(self.places) else ""
        return f"engine replica {i} (actor {self.names[i]}{place})"

    def _get_each(self, refs: list, doing: str, replicas: list[int] | None = None) -> list:
        """The answers of one ref per replica (``replicas``: their indices; all by default), in order, taken as they
        come: the first replica whose actor died is :class:`ReplicaFailed` naming it at once, whatever the others are
        still doing. A call that raised in a live replica raises its error (Ray's ``RayTaskError``, an instance of the
        error's class too), as the engine would in this process."""
        import ray

        replica_of = dict(zip(refs, range(len(refs)) if replicas is None else replicas))
        answers, pending = {}, list(refs)
        while pending:
            [ref], pending = ray.wait(pending, num_returns=1)
            i = replica_of[ref]
            try:
                answers[ref] = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self.failed = True
                raise ReplicaFailed(f"{self.replica_name(i)} died during {doing}: {_first_line(e)}") from e
        return [answers[ref] for ref in refs]

    def replicas(self) -> list[dict[str, Any]]:
        """Each replica's actor ``name`` (in the Ray namespace :data:`NAMESPACE`), ``pid``, node (``ip``, ``node_id``)
        and the ``weight_version`` it serves now."""
        described = self._get_each([a.describe.remote() for a in self.actors], "describe")
        return [{"name": name, **place} for name, place in zip(self.names, described)]

    @property
    def weight_version(self) -> int:
        """``UpdatesInFlight``: the weight version the replicas serve (each loads every sync, so between two syncs they
        agree; a disagreement is an error naming them). The versions of ``Completion.token_versions`` count the same."""
        versions = [place["weight_version"] for place in self._get_each([a.describe.remote() for a in self.actors], "describe")]
        if len(set(versions)) != 1:
            raise RuntimeError(f"the engine replicas serve different weight versions: "
                               + ", ".join(f"{self.replica_name(i)}: {v}" for i, v in enumerate(versions)))
        return versions[0]

    def stop_at(self, deadline: float | None) -> None:
        """``StopsAtDeadline``: the ``generate`` calls that follow end at ``deadline`` (this process's
        ``time.monotonic()``; None: no deadline). Each call sends it to its replicas as a wall-clock time."""
        self.deadline = deadline

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """Generate across the pool, balanced by tokens (every prompt's samples on one replica: its prefix cache then
        serves them); results in the prompts' order, each completion stamped with its replica's weight version."""
        plan = balance_prompts([len(p) for p in prompt_token_ids], sampling.n, sampling.max_tokens, len(self.actors))
        seeds = resolve_prompt_seeds(sampling.seed, sampling.prompt_seeds, len(prompt_token_ids))
        used = [e for e, idx in enumerate(plan) if idx]
        # wall clock: a replica on another node reads it on its own clock (off by the nodes' skew)
        deadline = None if self.deadline is None else time.time() + (self.deadline - time.monotonic())
        refs = [self.actors[e].generate.remote([prompt_token_ids[i] for i in plan[e]], _share(sampling, seeds, plan[e]), deadline)
                for e in used]
        results: list[list[Completion] | None] = [None] * len(prompt_token_ids)
        for e, answer in zip(used, self._get_each(refs, "generate", used)):
            for i, completions in zip(plan[e], answer):
                results[i] = completions
        return results

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        import ray

        return ray.get(self.actors[0].score.remote(token_ids))

    def update_weights(self, named_tensors) -> None:
        """Through Ray's object store: a fallback; :class:`WeightSyncCoordinator` streams instead."""
        import ray

        tensors = list(named_tensors)
        ray.get([a.update_weights.remote(tensors) for a in self.actors])

    def sleep(self) -> None:
        import ray

        ray.get([a.sleep.remote() for a in self.actors])

    def wake_up(self) -> None:
        import ray

        ray.get([a.wake_up.remote() for a in self.actors])

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """Stop the replicas this pool started (each asked, then killed, a dead one too; after a replica failed, all
        killed at once: the others may still be busy with the failed call) and free their placement group; an attached
        pool only lets go of them. Idempotent."""
        import ray
        from ray.util.placement_group import remove_placement_group

        actors, self.actors = self.actors, []
        if not self.owner:
            return
        if not self.failed:
            ray.wait([a.shutdown.remote() for a in actors], num_returns=len(actors), timeout=timeout_s)
        for a in actors:
            ray.kill(a, no_restart=True)
        if self.placement_group is not None and self._owns_group:
            remove_placement_group(self.placement_group)
        self.placement_group = None


def _actor_class():
    """:class:`EngineActor` as a Ray actor class whose methods run in their concurrency groups (``actor.py``)."""
    import ray

    for name, group in METHOD_GROUPS.items():
        ray.method(concurrency_group=group)(getattr(EngineActor, name))  # marks the method (once is enough)
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(EngineActor)


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _share(sampling: SamplingConfig, seeds: tuple[int, ...] | None, idx: list[int]) -> SamplingConfig:
    """``sampling`` for the prompts ``idx`` of a call: their own prompt seeds, whichever engine serves them."""
    return sampling if seeds is None else replace(sampling, prompt_seeds=tuple(seeds[i] for i in idx))


def share_engine_pool(trainer, cfg, kind: str, model_dir: str, engine_args: dict[str, Any], in_rank_bundles: bool = False):
    """Rank 0 starts the pool (and Ray, when no cluster is running) and the weight-sync coordinator; every other
    training rank joins rank 0's cluster, finds the same replicas by name and only takes part in parameter gathering.
    ``in_rank_bundles``: replica i goes into bundle i of the placement group rank 0 runs in (the service's rank actors,
    whose bundles are sized for a rank and its replica). Returns ``(pool, weight_sync, started_ray)``: ``started_ray``,
    whether this process initialized Ray."""
    import ray

    from arctic_rl.weight_sync.base import GatherOnlySync
    from arctic_rl.weight_sync.coordinator import WeightSyncCoordinator

    started_ray, shared, pool, sync = False, None, None, None
    if trainer.is_global_zero:
        if not ray.is_initialized():
            ray.init(address=init_address(cfg.address), include_dashboard=False, log_to_driver=False)
            started_ray = True
        if cfg.num_gpus_per_engine:
            engine_args = {**engine_args, "device": "cuda"}  # Ray sets CUDA_VISIBLE_DEVICES in the actor
        rank_bundles = None
        if in_rank_bundles:
            group = ray.util.get_current_placement_group()
            if group is None:
                raise RuntimeError("colocated engine replicas go into the training ranks' placement bundles, but this rank "
                                   "runs in no placement group (colocated replicas need the service's training.launcher: ray)")
            rank_bundles = (group, range(cfg.num_engines))
        pool = EnginePool(kind, model_dir, num_engines=cfg.num_engines, num_cpus=cfg.num_cpus_per_engine,
                          num_gpus=cfg.num_gpus_per_engine, placement_strategy=cfg.placement_strategy,
                          placement_timeout_s=cfg.timeout_s, ship_model_files=True, shared_bundles=rank_bundles, **engine_args)
        backend = cfg.weight_sync_backend or ("nccl" if cfg.num_gpus_per_engine else "gloo")
        on_gpu = backend in ("nccl", "cuda_ipc")  # the sender works from the trainer's own GPU
        # the replicas reach the sender's store at this node's address (they may run on other nodes)
        sync = WeightSyncCoordinator(pool.actors, backend=backend, bucket_bytes=cfg.weight_sync_bucket_mb << 20,
                                     timeout_s=cfg.timeout_s, host=ray.util.get_node_ip_address(),
                                     device=str(trainer.strategy.root_device) if on_gpu else "cpu")
        shared = (ray.get_runtime_context().gcs_address, pool.names)  # plain strings: any rank can read them
    gcs_address, names = trainer.strategy.broadcast(shared, src=0)
    if not trainer.is_global_zero:
        if not ray.is_initialized():
            ray.init(address=gcs_address, include_dashboard=False, log_to_driver=False)
            started_ray = True
        pool, sync = EnginePool.attach(names), GatherOnlySync()
    return pool, sync, started_ray
