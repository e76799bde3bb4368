"""One training rank of a several-rank service (``training.devices x num_nodes > 1``): the handler each rank serves.

``ranked.RankedCore`` starts every rank as ``python -m arctic_rl.serve.server --handler
arctic_rl.serve.ranks.worker:build_rank_handler`` on loopback with a fresh token (``ranks/processes.py``), or as a Ray
actor serving the same handler (``ranks/actors.py``), with the variables Lightning reads for a process it did not
launch itself (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``NODE_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``). Each rank runs the one-process machinery unchanged: a ``ServiceCore`` whose
Lightning run joins the others' process group (DeepSpeed over gloo on CPU, nccl on GPU). Only the front talks to
a rank; it sends each rank the same operations in the same order, with that rank's share of a batch.

The one difference from ``ops.CoreHandler``: ``save_state``, ``load_state`` and ``export`` paths were checked by
the front once (``targets.check_target``), before any rank touched the disk; a rank only confines the path under
``server.root_dir`` again (checking it on each rank would race with the folder another rank is writing). And a
rank registers the ``tinker.*`` losses (``serve/tinker/losses.py``) whatever the front's API: the front checked the
loss name against its own registry before sending it, so only a front serving ``--api tinker`` sends them.
"""

from __future__ import annotations

import importlib
from typing import Any

from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.core import ServiceCore
from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.ops import CoreHandler
from arctic_rl.serve.security import confine_path
from arctic_rl.serve.transport import Message

PATH_OPERATIONS = ("save_state", "load_state", "export")


class RankHandler:
    """The ``Handler`` of one training rank (see the module docstring)."""

    def __init__(self, core: ServiceCore) -> None:
        self.core = core
        self.handler = CoreHandler(core)

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        if op not in PATH_OPERATIONS:
            return self.handler.call(op, request, timeout_s)
        path = request.meta.get("path")
        if set(request.meta) != {"path"} or not isinstance(path, str) or request.tensors:
            raise RequestError(f"{op}: a rank takes exactly the meta field path (a string)")
        target = confine_path(self.core.config.server.root_dir, path)
        return Message({**self.core.call(op, timeout_s, path=target, shown=path), "path": path})

    def close(self) -> None:
        self.core.close()


def build_rank_handler(config: dict[str, Any]) -> RankHandler:
    """The handler factory of a rank process: always a one-process ``ServiceCore`` (never a ``RankedCore``),
    whose Lightning run is this process's rank of ``training.devices``."""
    importlib.import_module("arctic_rl.serve.tinker.losses")  # registers the tinker.* losses a Tinker front sends
    return RankHandler(ServiceCore(ArcticRLClientConfig.load(config)))
