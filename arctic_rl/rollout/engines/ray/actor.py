"""``EngineActor``: one rollout engine in a Ray actor, with its end of the weight-sync group.

A handle's methods mirror ``RolloutEngine`` (``generate``, ``update_weights``, ``score``, ``sleep``,
``wake_up``, ``shutdown``) so an actor is used like a local engine, plus ``join_weight_group`` /
``receive_weights`` for :class:`~arctic_rl.weight_sync.coordinator.WeightSyncCoordinator`, and ``describe``: where it
runs and the weight version it serves (0 at start, the coordinator's sync id after each sync), which every completion
it samples carries too (``Completion.weight_version``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from arctic_rl.rollout.engines.base import Completion, ReceivesBroadcastWeights, ReceivesInPlace, SamplingConfig
from arctic_rl.rollout.engines.vllm.env import vllm_env

ENGINE_ENV = {
    **vllm_env(),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # always: the engine core in the actor's process, tensors over RPC
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
}


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

    def ready(self) -> bool:
        return True

    def describe(self) -> dict[str, Any]:
        """This replica's process id, node (``ip``, ``node_id``) and the weight version it serves."""
        import ray

        return {"pid": os.getpid(), "ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "weight_version": self.weight_version}

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        completions = self.engine.generate(prompt_token_ids, sampling)
        for per_prompt in completions:
            for completion in per_prompt:
                completion.weight_version = self.weight_version
        return completions

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        return self.engine.score(token_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)
        self.weight_version += 1

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
        """Receive sync ``sync_id`` bucket by bucket straight into the engine; returns tensors loaded."""
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
