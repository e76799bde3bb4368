"""The HTTP transport's client side: ``HttpTransport``, a ``Handler`` that POSTs wire bodies to a server."""

from __future__ import annotations

import socket

import httpx

from arctic_rl.serve import wire
from arctic_rl.serve.errors import AuthError, JobFailed, PayloadTooLarge, ServiceError, ServiceTimeout
from arctic_rl.serve.transport import Message

_ERRORS_BY_STATUS = {cls.status: cls for cls in (AuthError, PayloadTooLarge, JobFailed, ServiceTimeout)}


class HttpTransport:
    """``Handler`` over HTTP, on one persistent connection pool.

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        auth_token: sent as ``Authorization: Bearer <token>``.
        connect_timeout_s: how long to wait for a connection.
        call_timeout_s: how long a call waits for its reply unless ``call(timeout_s=...)`` says otherwise;
            the server gets it too (``timeout_s`` in the request), so a call still queued there expires.

    Errors: the server's error replies come back as the same ``ServiceError`` subclass with the server's
    message; a refused, reset or dropped connection is ``JobFailed``; no reply in time is ``ServiceTimeout``.
    ``close()`` only closes the connections: ending the job is the ``close`` operation's business.
    """

    def __init__(self, url: str, *, auth_token: str | None = None, connect_timeout_s: float = 10.0,
                 call_timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        headers = {"content-type": wire.CONTENT_TYPE, "accept": f"{wire.CONTENT_TYPE}, application/json"}
        if auth_token is not None:
            headers["authorization"] = f"Bearer {auth_token}"
        self._connect_timeout_s = connect_timeout_s
        self._call_timeout_s = call_timeout_s
        # TCP_NODELAY: headers and body go out as separate writes; without it the body waits for the
        # server's delayed ACK of the headers (about 40 ms per call on Linux loopback)
        nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self._client = httpx.Client(base_url=self.url, headers=headers, transport=nodelay)
        self._closed = False

    def call(self, op: str, request: Message, timeout_s: float | None = None) -> Message:
        """Run ``op`` on the server and return its reply (see the class for the errors)."""
        if self._closed:
            raise ServiceError(f"the HTTP transport to {self.url} is closed")
        timeout_s = self._call_timeout_s if timeout_s is None else timeout_s
        body = wire.encode(wire.Frame(op, request, timeout_s=timeout_s))  # checks op, so the path is safe
        try:
            reply = self._client.post(f"/v1/ops/{op}", content=body,
                                      timeout=httpx.Timeout(timeout_s, connect=self._connect_timeout_s))
        except httpx.TimeoutException as e:
            raise ServiceTimeout(f"{op!r} got no answer from {self.url} within {timeout_s:g} s "
                                 f"({type(e).__name__})") from e
        except httpx.TransportError as e:
            raise JobFailed(f"the server at {self.url} is unreachable or died during {op!r}: "
                            f"{type(e).__name__}: {e}") from e
        if reply.status_code != 200:
            raise _error_of(reply, self.url)
        return wire.open_reply(reply.content, op)

    def health(self) -> dict:
        """The server's ``GET /v1/health`` (status, version, protocol, max_request_bytes)."""
        try:
            reply = self._client.get("/v1/health", timeout=self._connect_timeout_s)
        except httpx.TransportError as e:
            raise JobFailed(f"the server at {self.url} is unreachable: {type(e).__name__}: {e}") from e
        if reply.status_code != 200:
            raise _error_of(reply, self.url)
        return reply.json()

    def close(self) -> None:
        """Close the connections (idempotent)."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> HttpTransport:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _error_of(reply: httpx.Response, url: str) -> ServiceError:
    """The error a non-200 reply stands for: by its ``{"error", "message"}`` body, else by its status."""
    try:
        return wire.error_from_fields(reply.json())
    except (ValueError, KeyError, TypeError):  # not our JSON: a proxy, or not an arctic-rl server at all
        cls = _ERRORS_BY_STATUS.get(reply.status_code, ServiceError)
        return cls(f"HTTP {reply.status_code} from {url}{reply.request.url.path}: {reply.text[:300]}")
