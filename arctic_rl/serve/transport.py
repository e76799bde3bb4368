"""The one boundary between a transport (in-process, HTTP, Ray) and the core: ``Handler.call``.

A request is an operation name, JSON-able metadata and named tensors; so is its reply. The HTTP
and Ray transports only move these three things (``wire.py`` encodes them); ``ops.CoreHandler`` turns
them into calls of the core's plain methods."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Message:
    """One request or reply: ``meta`` is JSON-able (str/int/float/bool/None, lists, dicts),
    ``tensors`` are CPU tensors by name."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Handler(Protocol):
    """What a transport serves: ``ops.CoreHandler`` over a live core (or a client-side transport)."""

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        """Run ``op``; raise a ``serve.errors.ServiceError`` subclass on failure."""
        ...

    def close(self) -> None:
        """End the job (idempotent)."""
        ...
