"""Retries that must not run twice: a ``forward_backward`` or ``optim_step`` request may carry a
``request_id``; the core remembers the last :data:`REMEMBERED` ids with a digest of their request and the
future of their answer, so a retry with the same id gets the first call's answer (waiting for it while it
still runs) instead of accumulating gradients or stepping again. An id sent again with another request is
refused. Without a ``request_id`` every request runs (the protocol's behaviour before ids)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from arctic_rl.serve.errors import RequestError
from arctic_rl.serve.transport import Message

REMEMBERED = 1024  # ids kept per job (the oldest is forgotten first)
MAX_ID_CHARS = 128


def check_request_id(value: object) -> str | None:
    """A request's ``request_id`` field: None, or a non-empty string of at most :data:`MAX_ID_CHARS`."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise RequestError(f"request_id must be a non-empty string of at most {MAX_ID_CHARS} characters, got {value!r:.60}")
    return value


def digest_of(message: Message) -> str:
    """A fingerprint of a request: its meta (as sorted JSON) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(json.dumps(message.meta, sort_keys=True, default=str).encode())
    for name in sorted(message.tensors):
        tensor = message.tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


class RecentRequests:
    """The answers (futures) of the last requests that carried an id, by ``(operation, request_id)``."""

    def __init__(self, limit: int = REMEMBERED) -> None:
        self._limit = limit
        self._futures: OrderedDict[tuple[str, str], tuple[str, Future]] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, operation: str, request_id: str, digest: str, future: Future) -> Future | None:
        """The future of an earlier request with this id (a retry), or None after remembering ``future`` as this
        id's (a first call; also when the earlier one was cancelled before it started, so it never ran).

        Raises:
            RequestError: the id was used for a different request.
        """
        key = (operation, request_id)
        with self._lock:
            earlier = self._futures.get(key)
            if earlier is not None and not earlier[1].cancelled():
                if earlier[0] != digest:
                    raise RequestError(f"request_id {request_id!r} was already used for a different {operation} request; "
                                       "give each new request a new id (and a retry the same one)")
                return earlier[1]
            self._futures[key] = (digest, future)
            self._futures.move_to_end(key)
            while len(self._futures) > self._limit:
                self._futures.popitem(last=False)
            return None


def replayed(answer: Any) -> Any:
    """A remembered answer as a retry gets it: marked ``replayed: True`` (the operation did not run again)."""
    return {**answer, "replayed": True} if isinstance(answer, dict) else answer
