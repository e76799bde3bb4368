"""``Ranks``: where a several-rank job's training ranks run and how the front reaches them, behind one interface
(``ranked.RankedCore`` drives either kind the same way): local rank processes (``processes.py``,
``training.launcher: processes``) or one Ray actor per rank on a cluster (``actors.py``, ``training.launcher: ray``).

Every rank serves the same handler, ``worker.build_rank_handler`` (:data:`RANK_HANDLER`), whose ``ServiceCore``
joins the others' process group through the variables Lightning reads (``RANK``, ``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), which the placement sets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from arctic_rl.serve.config import ArcticRLClientConfig
from arctic_rl.serve.transport import Message

RANK_HANDLER = "arctic_rl.serve.ranks.worker:build_rank_handler"


class Ranks(ABC):
    """A job's ``training.devices x training.num_nodes`` ranks: started together, each called on its own, stopped
    together. ``start`` raises ``JobFailed`` (or ``ServiceTimeout``) naming what did not start, having stopped what did."""

    def __init__(self, config: ArcticRLClientConfig) -> None:
        self.config = config
        self.world_size = config.training.world_size

    @abstractmethod
    def start(self, rank_config: dict[str, Any]) -> None:
        """Start every rank serving ``rank_config`` (its handler built; its training run starts on its first call)."""

    @abstractmethod
    def call(self, rank: int, op: str, request: Message, timeout_s: float) -> Message:
        """``op`` on rank ``rank`` (errors as a transport's: ``ServiceError`` subclasses)."""

    @property
    @abstractmethod
    def pids(self) -> list[int]:
        """The ranks' process ids (empty before ``start``)."""

    @property
    @abstractmethod
    def nodes(self) -> list[str]:
        """Each rank's node: a Ray node id, or ``local`` for a process of this machine (empty before ``start``)."""

    @abstractmethod
    def where(self, rank: int) -> str:
        """Rank ``rank``'s place for a message: ``" on node <ip> (<id>)"``, or empty on this machine."""

    @abstractmethod
    def dead(self, errors: dict[int, BaseException]) -> list[tuple[int, str]]:
        """``(rank, how it ended in words)`` of the ranks that are gone; ``errors`` are the failed calls by rank
        (a rank whose call failed may need a moment to be seen gone)."""

    @abstractmethod
    def stop(self, timeout_s: float) -> None:
        """Ask every rank to stop at once (each closes its training loop, which ends with a barrier of all ranks),
        then end each: killed after ``timeout_s``. Nothing of the ranks is left running. Idempotent."""

