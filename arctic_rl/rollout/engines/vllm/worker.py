"""A vLLM worker extension: each engine worker (one per tensor-parallel rank) receives the weights itself.

vLLM mixes this class into its workers (``LLM(..., worker_extension_cls=...)``) and ``collective_rpc``
calls its methods on every worker. With tensor parallelism the workers are separate processes, so an
iterator cannot be handed to them from the engine's process: instead every worker joins the
weight-sync group as its own rank (``base_rank + tensor-parallel rank``), receives the full tensors
of each sync (broadcast, or mapped through CUDA IPC) and loads them with its own in-place
``reload_weights``, which shards them for its rank. With one worker this runs in the engine's process.
"""

from __future__ import annotations

import logging

import torch

EXTENSION = "arctic_rl.rollout.engines.vllm.worker.WeightSyncWorkerExtension"
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _RotaryReloadFilter(logging.Filter):
    """vLLM warns ``RotaryEmbedding: Failed to load weights`` on every in-place reload: a rotary
    layer's cos/sin cache is derived from the config, in no checkpoint, and vLLM keeps it as it was.
    Dropped for rotary layers only; any other layer that loads nothing still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.msg == "%s: Failed to load weights" and record.args and "RotaryEmbedding" in str(record.args[0])
        )


def quiet_rotary_reload_warning() -> None:
    """Install ``_RotaryReloadFilter`` on vLLM's reload logger in this process (idempotent)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(_RotaryReloadFilter())


class WeightSyncWorkerExtension:
    """Methods added to vLLM's worker class (``self`` is the worker: ``self.rank``, ``self.device``)."""

    def arctic_join_weight_group(self, address, base_rank: int) -> int:
        """Join the coordinator's group as rank ``base_rank + self.rank``; returns that rank."""
        from arctic_rl.weight_sync.receiver import WeightReceiver

        device = getattr(self, "device", None)
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._arctic_receiver = WeightReceiver.join(address, base_rank + int(self.rank), device)
        quiet_rotary_reload_warning()  # this worker may be its own process
        return self._arctic_receiver.rank

    def arctic_receive_weights(self, sync_id: int) -> int:
        """Receive sync ``sync_id`` and reload it in place; returns the number of tensors loaded."""
        receiver = getattr(self, "_arctic_receiver", None)
        if receiver is None:
            raise RuntimeError("arctic_receive_weights before arctic_join_weight_group")
        return receiver.receive(sync_id, lambda items: self.reload_weights(weights_iterator=items))
