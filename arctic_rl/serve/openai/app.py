"""The OpenAI transport (``arctic-rl serve --api openai``): ``/v1/chat/completions`` and ``/v1/completions`` in OpenAI's
JSON (and SSE when ``stream``), ``/v1/models``, the recorded episodes (``/v1/episodes/...``), beside the service's own
routes (``/v1/ops/{op}``) on one app with one token. It only translates; ``OpenAIService`` decides."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from arctic_rl.serve import wire
from arctic_rl.serve.errors import RequestError, ServiceError
from arctic_rl.serve.openai.collect import collect
from arctic_rl.serve.openai.fields import CHAT_FIELDS, REFUSED_FIELDS
from arctic_rl.serve.openai.service import OpenAIService, Sampled
from arctic_rl.serve.security import check_bearer
from arctic_rl.serve.transports.http_app import read_limited

logger = logging.getLogger(__name__)
SESSION_HEADER = "x-session-id"
FIELD = re.compile(r"^(([A-Za-z_-]+)(?:\[\d+\]|\.[A-Za-z_]+)*)([: =])")  # a refusal's message starts with its field
REQUEST_FIELDS = {"messages", "tools", "tool_choice", "prompt", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
                  "logprobs", "stream", "stream_options", "user", "X-Session-Id", "session_ids", "rewards", "group",
                  *REFUSED_FIELDS, *CHAT_FIELDS}


def add_openai_routes(app: FastAPI, service: OpenAIService, *, auth_token: str | None, max_request_bytes: int) -> FastAPI:
    """Add the OpenAI routes to ``app`` (the service's app); each needs ``Authorization: Bearer <token>``."""

    def require_token(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), auth_token)

    async def body(request: Request) -> dict[str, Any]:
        try:
            parsed = json.loads(await read_limited(request, max_request_bytes) or b"null")
        except ValueError as e:
            raise RequestError(f"the body is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise RequestError("the body must be a JSON object")
        return parsed

    async def complete(request: Request, chat: bool) -> Response:
        try:
            sampled = await run_in_threadpool(service.sample, await body(request), request.headers.get(SESSION_HEADER), chat)
        except Exception as e:  # noqa: BLE001  (every failure is an answer)
            return openai_error(e)
        if not sampled.sampling.stream:
            return JSONResponse(service.answer(sampled))
        return StreamingResponse(_events(service, sampled), media_type="text/event-stream")

    @app.post("/v1/chat/completions", dependencies=[Depends(require_token)])
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(require_token)])
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.get("/v1/models", dependencies=[Depends(require_token)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "arctic-rl"}]}

    @app.get("/v1/episodes/{session_id}", dependencies=[Depends(require_token)])
    async def episode(session_id: str) -> Response:
        try:
            recorded = service.store.get(session_id)
        except ServiceError as e:
            return openai_error(e)
        return JSONResponse({"session_id": session_id, "divergences": recorded.divergences,
                             "segments": [s.as_json() for s in recorded.segments]})

    @app.delete("/v1/episodes/{session_id}", dependencies=[Depends(require_token)])
    async def drop_episode(session_id: str) -> Response:
        try:
            service.store.drop(session_id)
        except ServiceError as e:
            return openai_error(e)
        return JSONResponse({"session_id": session_id, "dropped": True})

    @app.post("/v1/episodes/collect", dependencies=[Depends(require_token)])
    async def collect_episodes(request: Request) -> Response:
        """``{"session_ids", "rewards", "group"}`` -> the ``TrainBatch`` in the service's wire format (op ``collect``)."""
        try:
            req = await body(request)
            batch = collect(service.store, req.get("session_ids"), req.get("rewards"), bool(req.get("group", False)))
        except Exception as e:  # noqa: BLE001
            return openai_error(e)
        return Response(wire.encode(wire.Frame("collect", batch.to_message())), media_type=wire.CONTENT_TYPE)

    return app


async def _events(service: OpenAIService, sampled: Sampled):
    """Server-sent events of the answer; a client that leaves mid-stream leaves its episode recorded, flagged."""
    try:
        for chunk in service.stream_chunks(sampled):
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0)  # let a disconnect be noticed between chunks
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        service.store.mark_disconnected(sampled.session_id, sampled.segments)
        raise


def openai_error(error: Exception) -> JSONResponse:
    """OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` with the error's status."""
    if not isinstance(error, ServiceError):
        logger.error("answering 500: %s: %s", type(error).__name__, error)
    status = error.status if isinstance(error, ServiceError) else 500
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "server_error")
    message = str(error)
    named = FIELD.match(message)
    param = named.group(1) if status == 400 and named and (named.group(2) in REQUEST_FIELDS or named.group(3) == ":") else None
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)
