"""``EngineActor``: one rollout engine in a Ray actor, with its end of the weight-sync group.

A handle's methods mirror ``RolloutEngine`` (``generate``, ``update_weights``, ``score``, ``sleep``,
``wake_up``, ``shutdown``) so an actor is used like a local engine, plus ``join_weight_group`` /
``receive_weights`` for :class:`~arctic_rl.weight_sync.coordinator.WeightSyncCoordinator`, and ``describe``: where it
runs and the weight version it serves (0 at start, the coordinator's sync id after each sync), which every completion
it samples carries too (``Completion.weight_version``).

**Calls beside ``generate``.** The actor runs its methods in Ray concurrency groups (:data:`CONCURRENCY_GROUPS`,
:data:`METHOD_GROUPS`): the engine calls (``generate``, ``score``, ``sleep``, ``wake_up``, ``shutdown``) one at a time
in the default group, weight loads (``receive_weights``, ``update_weights``) on a thread of their own, ``describe`` on
another. So a sync may arrive while a ``generate`` decodes: the engine (``UpdatesInFlight``) pauses its decode loop at
its next step boundary, loads, and goes on with the requests it holds (``engines/in_flight.py``). Each token's version
(``Completion.token_versions``) is this replica's version of the weights that sampled it: the engine counts its own
loads, and the actor records, before each load, which sync id the engine's next version is.

**Deadlines.** ``generate(..., deadline=...)`` takes the end of the call as a wall-clock time (``time.time()``, seconds
since the epoch): a replica may run on another node, whose monotonic clock is unrelated to the caller's. The actor turns
it into its own ``time.monotonic()`` on arrival (``StopsAtDeadline``). Clock skew between the caller's node and the
replica's moves the replica's deadline by the skew (a replica whose clock is ahead stops that much early); NTP-synced
nodes differ by milliseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from arctic_rl.rollout.engines.base import (Completion, ReceivesBroadcastWeights, ReceivesInPlace, SamplingConfig,
                                            StopsAtDeadline, UpdatesInFlight)
from arctic_rl.rollout.engines.vllm.env import vllm_env

ENGINE_ENV = {
    **vllm_env(),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # always: the engine core in the actor's process, tensors over RPC
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
}

# Ray concurrency groups of the actor (each one thread): weight loads, and ``describe``, run beside ``generate``
CONCURRENCY_GROUPS = {"weights": 1, "control": 1}
METHOD_GROUPS = {"num_weight_receivers": "weights", "join_weight_group": "weights", "receive_weights": "weights",
                 "update_weights": "weights", "describe": "control"}  # the other methods: the default group (one at a time)


class EngineActor:
    """Body of the Ray actor (wrapped with ``ray.remote`` by :class:`EnginePool`)."""

    def __init__(self, kind: str, model_path: str, *, dtype: str, max_model_len: int, seed: int, device: str,
                 engine_kwargs: dict[str, Any] | None = None, model_files: dict[str, bytes] | None = None) -> None:
        """``model_files``: the model directory's files, shipped through Ray (an engine on another node
        cannot read the trainer's temporary directory); written to a local directory first."""
        from arctic_rl.rollout.engines.factory import make_engine

        self._local_dir = None
        if model_files is not None:
            import tempfile

            from arctic_rl.temp_dirs import remove_dead_runs, run_temp_dir

            remove_dead_runs()  # this node's leftovers of killed runs
            self._local_dir = model_path = tempfile.mkdtemp(prefix="arctic-rl-engine-", dir=run_temp_dir())
            for name, data in model_files.items():
                with open(os.path.join(model_path, name), "wb") as f:
                    f.write(data)
        self.device = torch.device(device)
        self.engine = make_engine(kind, model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device,
                                  engine_kwargs=dict(engine_kwargs or {}))
        self._receiver = None  # WeightReceiver once this actor joined the weight-sync group itself
        self.weight_version = 0  # the start-up weights
        # an engine that takes weights while it decodes: its own versions (+1 per load) -> this replica's (sync ids)
        self._versions = {self.engine.weight_version: 0} if isinstance(self.engine, UpdatesInFlight) else None

    def ready(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        """This replica's process id, node (``ip``, ``node_id``) and the weight version it serves."""
        import ray

        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "weight_version": self.weight_version}

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 deadline: float | None = None) -> list[list[Completion]]:
        """``RolloutEngine.generate``; ``deadline``: wall-clock time (``time.time()``) at which the call ends early
        (``StopsAtDeadline``; see the module docstring). Each completion carries this replica's weight versions: per
        token (an engine that ``UpdatesInFlight``), and ``weight_version``, the newest weights that sampled it."""
        if deadline is not None:
            if not isinstance(self.engine, StopsAtDeadline):
                raise TypeError(f"{type(self.engine).__name__} cannot stop at a deadline")
            self.engine.stop_at(time.monotonic() + (deadline - time.time()))  # this node's clock from here on
        try:
            completions = self.engine.generate(prompt_token_ids, sampling)
        finally:
            if deadline is not None:
                self.engine.stop_at(None)
        for per_prompt in completions:
            for completion in per_prompt:
                if self._versions is not None and completion.token_versions is not None:
                    completion.token_versions = [self._versions[v] for v in completion.token_versions]
                versions = completion.token_versions
                completion.weight_version = versions[-1] if versions else self.weight_version
        return completions

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self.engine.score(token_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._loading(self.weight_version + 1)
        self.engine.update_weights(named_tensors)
        self.weight_version += 1

    def _loading(self, version: int) -> None:
        """Before a load: the engine's next version will be this replica's ``version`` (recorded first, as tokens of
        the new weights may be sampled before the load call returns here)."""
        if self._versions is not None:
            self._versions[self.engine.weight_version + 1] = version

    def num_weight_receivers(self) -> int:
        """Ranks this engine takes in the weight-sync group: one per vLLM worker (tensor parallelism)."""
        return self.engine.num_weight_receivers if isinstance(self.engine, ReceivesBroadcastWeights) else 1

    def join_weight_group(self, address, rank: int) -> None:
        """Join the coordinator's group as ranks ``rank ..`` (blocks until every member has joined).
        A vLLM engine's workers join themselves (``engines/vllm/worker.py``); other engines join here."""
        from arctic_rl.weight_sync.receiver import WeightReceiver

        if isinstance(self.engine, ReceivesBroadcastWeights):
            self.engine.join_weight_group(address, rank)
            return
        self._receiver = WeightReceiver.join(address, rank, self.device)

    def receive_weights(self, sync_id: int) -> int:
        """Receive sync ``sync_id`` bucket by bucket straight into the engine; returns tensors loaded. A ``generate``
        running meanwhile pauses at its next step boundary for the load (the engine's ``UpdatesInFlight``)."""
        self._loading(sync_id)
        if isinstance(self.engine, ReceivesBroadcastWeights):  # its workers joined the group themselves
            loaded = self.engine.receive_weights(sync_id)
        elif self._receiver is None:
            raise RuntimeError("receive_weights before join_weight_group")
        else:
            # an engine that offers its parameters gets each tensor broadcast straight into them
            target = self.engine.weight_target if isinstance(self.engine, ReceivesInPlace) else None
            loaded = self._receiver.receive(sync_id, self.engine.update_weights, target)
        self.weight_version = sync_id  # the coordinator's version of these weights
        return loaded

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self._local_dir is not None:
            import shutil

            shutil.rmtree(self._local_dir, ignore_errors=True)
        self._receiver = None
