"""What both network transports run per request: decode the wire bytes, call the handler one op at a time, encode."""

from __future__ import annotations

import logging
import threading
import time

from arctic_rl.serve import wire
from arctic_rl.serve.errors import RequestError, ServiceError, ServiceTimeout
from arctic_rl.serve.transport import Handler, Message

logger = logging.getLogger(__name__)


class Endpoint:
    """Answers wire requests with ``handler``, one op at a time: later requests wait on a lock until their
    deadline (the request's ``timeout_s`` capped by ``call_timeout_s``, counted from its arrival)."""

    def __init__(self, handler: Handler, *, max_request_bytes: int, call_timeout_s: float | None = None):
        self.handler = handler
        self._limits = wire.WireLimits(max_bytes=max_request_bytes)
        self._call_timeout_s = call_timeout_s
        self._lock = threading.Lock()

    def answer(self, op: str, body: bytes, received_at: float | None = None) -> bytes:
        """The reply's wire bytes to ``body``, a request sent for ``op``. Raises a ``ServiceError`` (or
        whatever the handler raised); ``received_at`` is the request's ``time.monotonic()`` arrival."""
        received_at = time.monotonic() if received_at is None else received_at
        frame = wire.decode(body, self._limits)
        if frame.op != op:
            raise RequestError(f"the body is a request for {frame.op!r} but was sent to {op!r}")
        if frame.error is not None:
            raise RequestError("a request must not carry an error")
        limits = [t for t in (frame.timeout_s, self._call_timeout_s) if t is not None]
        timeout_s = min(limits) if limits else None
        deadline = None if timeout_s is None else received_at + timeout_s
        expired = f"{op!r} did not start: it waited its timeout of {timeout_s} s for the operations ahead of it"
        if not self._lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise ServiceTimeout(expired)
        try:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ServiceTimeout(expired)
            reply = self.handler.call(op, frame.message, timeout_s=remaining)
        except ServiceError:
            raise
        except Exception:
            logger.exception("operation %r failed inside the handler", op)
            raise
        finally:
            self._lock.release()
        try:
            # a non-finite metric (a skipped step's grad_norm) as "NaN"/"Infinity"/"-Infinity": a result always renders
            return wire.encode(wire.Frame(op, Message(wire.readable_json(reply.meta), reply.tensors)))
        except RequestError as e:  # the handler's fault, not the caller's: answered as a server error
            raise ServiceError(f"the reply of {op!r} cannot be sent: {e}") from e
