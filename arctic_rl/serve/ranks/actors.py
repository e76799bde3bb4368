"""``RayRanks``: a job's training ranks as Ray actors (``training.launcher: ray``), one per rank, placed by a placement
group of one bundle per rank (``ray.placement_strategy``: ``PACK`` by default, ``SPREAD`` over nodes), so the ranks
may span the cluster's nodes.

Start-up, from the front (the process of ``ranked.RankedCore``):
1. join the cluster at ``ray.address`` (:func:`join_cluster`; nothing listening there: one line saying how to start one);
2. reserve the placement group and start a :class:`RankActor` in each bundle;
3. each actor reports its node (IP and Ray node id) and process id; rank 0 also a free port on its node: torch.distributed
   meets there (``MASTER_ADDR``, ``MASTER_PORT``);
4. each actor then builds the rank handler a rank process serves (``worker.build_rank_handler``, inside a
   ``ServiceActor``), with the variables Lightning reads. To Lightning every actor is a node of one device
   (``LOCAL_RANK`` 0, ``NODE_RANK`` = its rank, ``devices: 1``, ``num_nodes``: the ranks), since Ray shows an actor only
   its own GPU; DeepSpeed then reduces over gloo on CPU, nccl on GPU.

A rank's actor that dies (its process killed, its node lost) is seen by its call failing with Ray's ``RayActorError``;
``stop`` closes every actor, kills it, and removes the placement group.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from arctic_rl.ray_address import init_address
from arctic_rl.serve.errors import JobFailed, ServiceTimeout
from arctic_rl.serve.ranks.placement import RANK_HANDLER, Ranks
from arctic_rl.serve.transport import Message

ACTOR_THREADS = 4  # a call runs while close() (or the next call, queued on the handler's deadline) comes in


class RankActor:
    """One training rank (a plain class: ``ray.remote(RankActor)`` makes the actor; see the module docstring)."""

    def __init__(self) -> None:
        self.service = None  # the ServiceActor serving the rank handler, once serve() ran

    def where(self, with_port: bool) -> dict[str, Any]:
        """This actor's node (``ip``, ``node_id``), process id, and with ``with_port`` a free port on its node."""
        import ray

        from arctic_rl.weight_sync.broadcast import free_port

        ip = ray.util.get_node_ip_address()
        return {"ip": ip, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "port": free_port(ip) if with_port else None}

    def serve(self, config: dict[str, Any], env: dict[str, str], max_request_bytes: int) -> None:
        """Build the rank handler for ``config`` with ``env`` (the rank's variables) in this process's environment."""
        from arctic_rl.serve.transports.ray_actor import ServiceActor

        os.environ.update(env)
        self.service = ServiceActor(RANK_HANDLER, config, max_request_bytes)

    def call(self, op: str, payload: bytes) -> bytes:
        return self.service.call(op, payload)

    def close(self) -> None:
        if self.service is not None:
            self.service.close()


def no_cluster_text(address: str | None, reason: object) -> str:
    """The one line of a cluster that cannot be reached: what was tried and how to start one."""
    port = urlsplit(f"//{address.removeprefix('ray://')}").port if address not in (None, "auto") else None
    if port and address.startswith("ray://"):  # Ray Client's port; the nodes join the head's own (6379 by default)
        head, gcs = f"ray start --head --ray-client-server-port={port}", 6379
    else:
        head, gcs = f"ray start --head --port={port}" if port else "ray start --head", port or 6379
    return (f"no Ray cluster reachable at ray.address={address!r} ({reason}); start one with `{head}` on the head node "
            f"(and `ray start --address=<head ip>:{gcs}` on every other node), or set ray.address to a running one")


def join_cluster(address: str | None, connect_s: float) -> bool:
    """Join the Ray cluster at ``address`` unless this process already runs Ray; None starts a local one. An address of
    the form ``host:port`` (``ray://`` too) is probed first, so a cluster that is not there fails at once instead of
    Ray's own minutes of retries. Returns whether Ray was initialized here (the caller then shuts it down).

    Raises:
        JobFailed: no cluster reachable (:func:`no_cluster_text`).
    """
    import ray

    if ray.is_initialized():
        return False
    if address not in (None, "auto"):
        parts = urlsplit(f"//{address.removeprefix('ray://')}")
        try:
            socket.create_connection((parts.hostname, parts.port or 6379), timeout=connect_s).close()
        except (OSError, ValueError) as e:
            raise JobFailed(no_cluster_text(address, e)) from None
    try:
        ray.init(address=init_address(address), include_dashboard=False)
    except ConnectionError as e:
        raise JobFailed(no_cluster_text(address, str(e).splitlines()[0])) from None
    return True


def rank_bundles(config) -> list[dict[str, float]]:
    """One placement bundle per rank: ``ray.cpus_per_worker`` (and ``gpus_per_worker``); with colocated engines
    (``engines.colocated``), each of the first ``engines.num_engines`` bundles also holds its replica's
    ``num_cpus_per_engine`` and ``num_gpus_per_engine`` (the replica is started in it: ``ray/pool.py``)."""
    r, e = config.ray, config.engines
    bundles = []
    for rank in range(config.training.world_size):
        with_engine = config.replicas_in_rank_bundles and rank < e.num_engines
        cpus = r.cpus_per_worker + (e.num_cpus_per_engine if with_engine else 0)
        gpus = r.gpus_per_worker + (e.num_gpus_per_engine if with_engine else 0)
        bundles.append({"CPU": cpus, **({"GPU": gpus} if gpus else {})})
    return bundles


class RayRanks(Ranks):
    """The ranks as :class:`RankActor` s (see the module docstring)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.actors: list = []
        self.placed: list[dict[str, Any]] = []  # each rank's where()
        self.placement_group = None
        self._started_ray = False

    @property
    def pids(self) -> list[int]:
        return [place["pid"] for place in self.placed]

    @property
    def nodes(self) -> list[str]:
        return [place["node_id"] for place in self.placed]

    def where(self, rank: int) -> str:
        if rank >= len(self.placed):
            return ""
        return f" on node {self.placed[rank]['ip']} ({self.placed[rank]['node_id'][:12]})"

    def start(self, rank_config: dict[str, Any]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r, t, timeouts = self.config.ray, self.config.training, self.config.timeouts
        self._started_ray = join_cluster(r.address, timeouts.connect_s)
        bundles, colocated = rank_bundles(self.config), self.config.replicas_in_rank_bundles
        self.placement_group = placement_group(bundles, strategy=r.placement_strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=timeouts.startup_s)
        except ray.exceptions.GetTimeoutError:
            raise ServiceTimeout(f"could not place {self.world_size} training ranks of {bundles} ({r.placement_strategy}) "
                                 f"within timeouts.startup_s={timeouts.startup_s:g}; the cluster has "
                                 f"{ray.available_resources()} available") from None
        actor_class = ray.remote(RankActor)
        self.actors = [actor_class.options(num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker, max_restarts=0,
                                           max_concurrency=ACTOR_THREADS,
                                           # colocated: rank 0 finds its group (its replicas start in the bundles)
                                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                                               self.placement_group, i, placement_group_capture_child_tasks=colocated))
                       .remote() for i in range(self.world_size)]
        self.placed = self._get([a.where.remote(i == 0) for i, a in enumerate(self.actors)], "report its node")
        # every actor is a Lightning node of one device (the module docstring)
        config = {**rank_config, "training": {**rank_config["training"], "devices": 1, "num_nodes": self.world_size}}
        common = {"MASTER_ADDR": self.placed[0]["ip"], "MASTER_PORT": str(self.placed[0]["port"]), "LOCAL_RANK": "0",
                  "WORLD_SIZE": str(self.world_size), "OMP_NUM_THREADS": str(max(1, int(r.cpus_per_worker)))}
        max_bytes = int(self.config.server.max_request_mb * 2**20)
        self._get([a.serve.remote(config, {**common, "RANK": str(i), "NODE_RANK": str(i)}, max_bytes)
                   for i, a in enumerate(self.actors)], "build its handler")

    def _get(self, refs: list, doing: str) -> list:
        """``ray.get`` of one ref per rank within ``timeouts.startup_s``, a failure naming the rank."""
        import ray

        timeout = self.config.timeouts.startup_s
        results = []
        for rank, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=timeout))
            except ray.exceptions.GetTimeoutError:
                raise ServiceTimeout(f"training rank {rank}{self.where(rank)} did not {doing} within "
                                     f"timeouts.startup_s={timeout:g}") from None
            except ray.exceptions.RayError as e:
                raise JobFailed(f"training rank {rank}{self.where(rank)} did not {doing}: {e}") from e
        return results

    def call(self, rank: int, op: str, request: Message, timeout_s: float) -> Message:
        from arctic_rl.serve.transports.ray_actor import call_actor

        return call_actor(self.actors[rank], op, request, timeout_s, name=f"the actor of training rank {rank}")

    def dead(self, errors: dict[int, BaseException]) -> list[tuple[int, str]]:
        import ray

        return [(rank, "its actor died: " + str(e.__cause__).strip().splitlines()[0]) for rank, e in sorted(errors.items())
                if isinstance(e, JobFailed) and isinstance(e.__cause__, ray.exceptions.RayActorError)]

    def stop(self, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.actors:
            ray.wait([a.close.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.actors = []
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
