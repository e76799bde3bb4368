"""The OpenAI routes of an ``OpenAIService`` on a FastAPI app: ``/v1/chat/completions`` and ``/v1/completions`` in
OpenAI's JSON (and SSE when ``stream``, sent as the engine decodes: ``live.py``), ``/v1/models``; refusals in OpenAI's
error shape. They only translate; ``OpenAIService`` decides. The service (``arctic-rl serve --api openai``) adds its episode routes beside them; ``fit``'s
agent rollouts serve them alone on loopback."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.params import Depends
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from arctic_rl.errors import AuthError, RequestError, ServiceError
from arctic_rl.rollout.openai.fields import CHAT_FIELDS, REFUSED_FIELDS
from arctic_rl.rollout.openai.live import LiveStream
from arctic_rl.rollout.openai.service import OpenAIService

logger = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"
FIELD = re.compile(r"^(([A-Za-z_-]+)(?:\[\d+\]|\.[A-Za-z_]+)*)([: =])")  # a refusal's message starts with its field
REQUEST_FIELDS = {"messages", "tools", "tool_choice", "prompt", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
                  "logprobs", "stream", "stream_options", "user", "X-Session-Id", "session_ids", "rewards", "group",
                  *REFUSED_FIELDS, *CHAT_FIELDS}
_SAMPLING: set[asyncio.Task] = set()  # streamed requests' sampling tasks (the loop keeps only weak references)


def bearer_token(token: str) -> Depends:
    """A dependency that refuses (401) a request without ``Authorization: Bearer <token>`` (compared in constant time)."""
    import hmac

    from fastapi import Depends as depends

    expected = f"Bearer {token}".encode()

    def require_token(request: Request) -> None:
        if not hmac.compare_digest((request.headers.get("authorization") or "").encode(), expected):
            raise AuthError("missing or wrong Authorization: Bearer <token>")

    return depends(require_token)


async def read_body(request: Request) -> bytes:
    """The whole body (no size limit: for a server whose only clients are its own, on loopback)."""
    return await request.body()


def add_completion_routes(app: FastAPI, service: OpenAIService, *, dependencies: list[Depends],
                          read: Callable[[Request], Awaitable[bytes]] = read_body) -> Callable[[Request], Awaitable[dict]]:
    """Add the completion and model routes of ``service`` to ``app``, each behind ``dependencies`` (the caller's
    auth); ``read`` reads a request's body (the service's reader limits its size). Returns the JSON-object body parser
    the routes use (the caller's own routes reuse it)."""

    async def body(request: Request) -> dict[str, Any]:
        try:
            parsed = json.loads(await read(request) or b"null")
        except ValueError as e:
            raise RequestError(f"the body is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise RequestError("the body must be a JSON object")
        return parsed

    async def complete(request: Request, chat: bool) -> Response:
        try:
            asked = await run_in_threadpool(service.prepare, await body(request), request.headers.get(SESSION_HEADER), chat)
            if not asked.sampling.stream:
                return JSONResponse(service.answer(await run_in_threadpool(service.run, asked)))
        except Exception as e:  # noqa: BLE001  (every failure is an answer)
            return openai_error(e)
        live = LiveStream(service, asked, asyncio.get_running_loop())
        task = asyncio.ensure_future(run_in_threadpool(live.run))
        _SAMPLING.add(task)
        task.add_done_callback(_SAMPLING.discard)
        first = await live.first()  # the response starts with the first decode step; an error before it is a JSON error
        if isinstance(first, Exception):
            return openai_error(first)
        return StreamingResponse(_events(live, first), media_type="text/event-stream", background=BackgroundTask(live.leave))

    @app.post("/v1/chat/completions", dependencies=dependencies)
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions", dependencies=dependencies)
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.get("/v1/models", dependencies=dependencies)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "arctic-rl"}]}

    return body


async def _events(live: LiveStream, first):
    """Server-sent events of the answer as the engine decodes it, then ``[DONE]``; an error after the first chunk is
    one last event with OpenAI's error object (the SDK raises it). A client that leaves mid-stream (the server cancels
    this generator, or closes it) stops the engine and leaves its episode recorded, flagged (``LiveStream.leave``)."""
    try:
        try:
            async for chunk in live.chunks(first):
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:  # noqa: BLE001  (the status is sent: the error goes in the stream)
            yield f"data: {json.dumps(error_object(e)[1])}\n\n"
        else:
            yield "data: [DONE]\n\n"
        live.finished = True
    finally:
        live.leave()  # (nothing once finished)


def error_object(error: Exception) -> tuple[int, dict]:
    """The error's status and OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``."""
    if not isinstance(error, ServiceError):
        logger.error("answering 500: %s: %s", type(error).__name__, error)
    status = error.status if isinstance(error, ServiceError) else 500
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "server_error")
    message = str(error)
    named = FIELD.match(message)
    param = named.group(1) if status == 400 and named and (named.group(2) in REQUEST_FIELDS or named.group(3) == ":") else None
    return status, {"error": {"message": message, "type": kind, "param": param, "code": None}}


def openai_error(error: Exception) -> JSONResponse:
    """OpenAI's error object with the error's status, as a response."""
    status, body = error_object(error)
    return JSONResponse(body, status_code=status)
