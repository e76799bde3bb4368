"""``EngineHost``: the lifecycle of a training job's rollout engines (one in-process engine, or a pool of Ray engine
actors): started from the policy's current weights, given new weights, put to sleep and woken, shut down.
``RolloutCallback`` (``arctic-rl fit``) and the backend service's engines each hold one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from arctic_rl.errors import ConfigError
from arctic_rl.rollout.engines.base import Completion, DecodeListener, RolloutEngine, SamplingConfig, StreamsTokens
from arctic_rl.rollout.engines.factory import check_engine_dtype, engine_dtype, make_engine
from arctic_rl.rollout.engines.kinds import EngineChoice, check_engine_choice
from arctic_rl.rollout.engines.seeds import engine_seed
from arctic_rl.temp_dirs import run_temp_dir
from arctic_rl.weight_sync import InProcessWeightSync
from arctic_rl.weight_sync.base import GatherOnlySync, SyncReport, WeightSync

if TYPE_CHECKING:
    from arctic_rl.rollout.engines.ray.pool import EnginePool


@dataclass
class RayEngines:
    """Rollout engines as Ray actors instead of one in-process engine.

    Args:
        address: Ray cluster to join (``auto``: the one ``ray start`` made on this node); None starts a
            local cluster when none is running.
        num_engines: engine actors.
        num_cpus_per_engine: Ray CPUs reserved per engine.
        num_gpus_per_engine: GPUs per engine (fractional: colocated with training on the same GPU).
        placement_strategy: ``PACK`` (colocate) or ``SPREAD`` (over nodes).
        weight_sync_backend: ``gloo``, ``nccl`` or ``cuda_ipc`` (engines colocated on the GPU of training
            rank 0, the sender, map its buffers; no copy over a wire). None: nccl when engines have GPUs, else gloo.
        weight_sync_bucket_mb: broadcast bucket size (``cuda_ipc``: each of its two shared buffers).
        timeout_s: engine start-up and per-sync timeout.
    """

    address: str | None = None
    num_engines: int = 1
    num_cpus_per_engine: float = 1.0
    num_gpus_per_engine: float = 0.0
    placement_strategy: str = "PACK"
    weight_sync_backend: str | None = None
    weight_sync_bucket_mb: int = 256
    timeout_s: float = 300.0


class SeedSetting(Protocol):
    seed: int | None  # the sampling seed (``model.sampling.seed``); None: unseeded sampling


class EngineSettings(Protocol):
    sampling: SeedSetting


class EnginePolicy(Protocol):
    """What the host needs of the policy module: its dtype, lengths, seed and device, and the two ways its weights
    leave it. ``GRPOModule`` and the service's module both satisfy it (``modules/policy_module.py``)."""

    options: EngineSettings
    model_dtype: str  # the policy's parameter dtype (``float32``, ``bfloat16``, ...)
    max_prompt_length: int
    max_response_length: int
    device: torch.device

    def save_policy(self, directory: str | None, bucket_bytes: int = 256 << 20) -> None:
        """The policy and tokenizer as a ``save_pretrained`` directory; None: take part in the collective only."""

    def named_parameters_for_sync(self, bucket_bytes: int = 256 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every weight (a collective under ZeRO-3)."""

    @property
    def sync_tensors_stable(self) -> bool:
        """Whether each tensor ``named_parameters_for_sync`` yields stays valid until the walk ends (False under
        ZeRO-3, whose gathers last one bucket): a broadcast sync then sends them where they lie, with no copy."""


class EngineHost:
    """Starts, feeds, sleeps, wakes and stops a job's rollout engines.

    Args:
        engine: ``auto`` (vLLM when installed), ``vllm`` or ``transformers`` (``engines/kinds.py``).
        engine_kwargs: the engine's extra arguments; ``device`` places an in-process engine (default: the
            policy's device).
        ray: run the engines as a pool of Ray actors (:class:`RayEngines`); None: one in-process engine.
        where: the setting's owner in error messages (``RolloutCallback``, ``engines``).
        in_rank_bundles: with ``ray``, start replica i in bundle i of the placement group this training rank runs in
            (colocated with the service's rank actors) instead of in bundles of the pool's own.
    """

    def __init__(self, engine: EngineChoice = "auto", engine_kwargs: dict[str, Any] | None = None,
                 ray: RayEngines | None = None, where: str = "RolloutCallback", in_rank_bundles: bool = False) -> None:
        check_engine_choice(f"{where}.engine", engine)
        self.kind, self.engine_kwargs, self.ray = engine, dict(engine_kwargs or {}), ray
        if in_rank_bundles and ray is None:
            raise ValueError(f"{where}: in_rank_bundles places Ray engine replicas; it needs ray (RayEngines)")
        self.in_rank_bundles, self.where = in_rank_bundles, where
        self.engine: RolloutEngine | None = None  # None until started, and on a rank that holds no engine
        self.pool: EnginePool | None = None  # with ``ray``: the replicas (also ``engine``)
        self.weight_sync: WeightSync | None = None
        self.awake = True
        self.local_device: str | None = None  # an in-process engine's device
        self._directory: str | None = None
        self._started_ray = False

    def check(self, policy: EnginePolicy) -> None:
        """Refuse an engine that cannot run the policy's dtype, before any model or engine starts."""
        check_engine_dtype(self.kind, policy.model_dtype)

    def check_ranks(self, world_size: int, num_nodes: int) -> None:
        """Refuse, before anything starts, in-process engines that cannot run beside ``world_size`` training ranks:
        vLLM (its in-process engine joins the ranks' process group at start and waits for them forever) and more than
        one machine (the other machines' ranks cannot read the start-up weights rank 0 writes)."""
        if self.ray is not None or world_size == 1:
            return
        if num_nodes > 1:
            raise ConfigError(f"{self.where}: {world_size} training ranks on {num_nodes} machines need the engines as Ray actors"
                              f" ({self.where}.ray, and the config's ray section for the ranks); in-process engines run on one"
                              " machine")
        if self.kind == "vllm":  # (auto picks transformers here)
            raise ConfigError(f"{self.where}.engine: {self.kind!r} (vLLM in each of the {world_size} training ranks' processes) joins"
                              " the ranks' process group at start and waits forever; use engine: transformers (one engine per"
                              f" rank), or vLLM as Ray actors ({self.where}.ray)")

    def start(self, trainer: Any, policy: EnginePolicy, every_rank: bool = False) -> None:
        """Start the engines from the policy's weights as they are now (fresh, or restored from a checkpoint). With
        ``ray``, rank 0 starts the pool and every other training rank attaches to it (``ray/pool.py``). Without it,
        ``every_rank`` (``fit``: each training rank calls this): each rank starts its own in-process engine, all from
        the files rank 0 writes (one machine: :meth:`check_ranks` refuses the rest); otherwise only this rank does (the
        service's rank 0; its other ranks call :meth:`start_without_engine`)."""
        self._directory = tempfile.mkdtemp(prefix="arctic-rl-engine-", dir=run_temp_dir())  # see temp_dirs.py
        policy.save_policy(self._directory)
        engine_kwargs = dict(self.engine_kwargs)
        engine_args = dict(
            dtype=engine_dtype(policy.model_dtype, trainer.precision),
            max_model_len=policy.max_prompt_length + policy.max_response_length,
            seed=engine_seed(policy.options.sampling.seed),  # sampling.seed null: unseeded sampling, but the engine needs a seed
            device=engine_kwargs.pop("device", str(policy.device)),
            engine_kwargs=engine_kwargs,
        )
        if self.ray is not None:
            from arctic_rl.rollout.engines.ray.pool import share_engine_pool

            self.pool, self.weight_sync, self._started_ray = share_engine_pool(
                trainer, self.ray, self.kind, self._directory, engine_args, self.in_rank_bundles)
            self.engine = self.pool
        else:
            directory, several = self._directory, every_rank and trainer.world_size > 1
            if several:  # one engine per rank (on one machine): all start from the files rank 0 wrote
                directory = trainer.strategy.broadcast(self._directory, src=0)  # (transformers writes on rank 0 only)
            kind = "transformers" if self.kind == "auto" and several else self.kind  # vLLM cannot (check_ranks)
            self.engine = make_engine(kind, directory, **engine_args)
            self.weight_sync, self.local_device = InProcessWeightSync(self.engine), engine_args["device"]

    def start_without_engine(self, policy: EnginePolicy) -> None:
        """A training rank that holds no engine (ranks after 0 beside an in-process engine): it takes part in the
        collectives of rank 0's start-up save and of every weight push, and sends nothing."""
        policy.save_policy(None)
        self.weight_sync = GatherOnlySync()

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 listener: DecodeListener | None = None) -> list[list[Completion]]:
        """Sample with the engines; every completion carries the weight version that produced it (a replica of a
        pool stamps its own; an in-process engine serves the version of its last sync). A replica of a pool that
        dies meanwhile is ``ReplicaFailed`` naming it (``ray/pool.py``). ``listener``: told each decode step's tokens
        by an in-process engine that ``StreamsTokens``; never called by the others (vLLM, a Ray pool), which answer
        whole."""
        if listener is not None and isinstance(self.engine, StreamsTokens):
            completions = self.engine.generate_streamed(prompt_token_ids, sampling, listener)
        else:
            completions = self.engine.generate(prompt_token_ids, sampling)
        if self.pool is None:
            for per_prompt in completions:
                for completion in per_prompt:
                    completion.weight_version = self.weight_sync.version
        return completions

    def replicas(self) -> list[dict[str, Any]]:
        """Each engine replica's ``weight_version`` and where it runs (``pid``; a pool's: ``ip``, ``node_id``); empty on a
        rank that holds no engine."""
        if self.pool is not None:
            return self.pool.replicas()
        if self.engine is None:
            return []
        return [{"pid": os.getpid(), "ip": "in process", "node_id": "in process", "weight_version": self.weight_sync.version}]

    @property
    def shared_pool(self) -> bool:
        """Whether the engines are a Ray pool every training rank generates with (rank 0 owns it, the others attach)."""
        return self.pool is not None

    @property
    def owns_engines(self) -> bool:
        """Whether this rank puts the engines to sleep, wakes them and sends them weights: the rank that started them.
        A rank attached to another rank's pool leaves all three to it: its own calls would reach the replicas in no
        fixed order against the owner's (Ray orders an actor's calls per caller only), and a wake-up queued behind the
        owner's ``receive_weights`` waits for weights that this rank's part of a ZeRO-3 gather has yet to make."""
        return self.engine is not None and (self.pool is None or self.pool.owner)

    def sleep(self) -> None:
        """Free the accelerator memory of an awake engine (a colocated engine, while training runs); a no-op on a rank
        that does not own the engines."""
        if self.awake and self.owns_engines:
            self.engine.sleep()
            self.awake = False

    def wake(self) -> None:
        """Wake a sleeping engine (vLLM restores its slept weights on wake-up); a no-op on a rank that does not own
        the engines."""
        if not self.awake and self.owns_engines:
            self.engine.wake_up()
            self.awake = True

    def sync(self, policy: EnginePolicy) -> SyncReport:
        """Push the policy's weights into the engines (woken first: weights must land in an awake engine); on a
        rank that does not own them, take part in gathering the weights only. A collective: every training rank
        calls it."""
        self.wake()
        return self.weight_sync.sync(policy.named_parameters_for_sync(), stable=policy.sync_tensors_stable)

    def shutdown(self) -> None:
        """Stop the engines, remove their start-up weights, and stop Ray if this host started it (idempotent)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = self.pool = None
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
