"""The HTTP transport's server side: a FastAPI app that hands wire bodies to an ``Endpoint`` and back."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from arctic_rl._version import __version__
from arctic_rl.serve import wire
from arctic_rl.serve.errors import ERRORS_BY_NAME, JobFailed, PayloadTooLarge, RequestError, ServiceError
from arctic_rl.serve.security import check_bearer
from arctic_rl.serve.transports.serving import Endpoint
from arctic_rl.serve.transport import Handler

logger = logging.getLogger(__name__)
_WIRE_BODY = {wire.CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}
_ERROR_BODY = {"application/json": {"schema": {
    "type": "object", "required": ["error", "message"],
    "properties": {"error": {"type": "string", "description": "the ServiceError class, e.g. RequestError"},
                   "message": {"type": "string"}}}}}
_OP_DOC = {
    "requestBody": {"required": True, "content": _WIRE_BODY,
                    "description": "A wire message (arctic_rl/serve/wire.py):\n\n" + wire.__doc__},
}
_OP_RESPONSES = {
    200: {"content": _WIRE_BODY, "description": "The reply, a wire message for the same op."},
    **{cls.status: {"content": _ERROR_BODY, "description": f"{name}: {cls.__doc__.splitlines()[0]}"}
       for name, cls in ERRORS_BY_NAME.items()},
}


def create_app(handler: Handler, *, auth_token: str | None, max_request_bytes: int,
               call_timeout_s: float | None) -> FastAPI:
    """The service's app: ``POST /v1/ops/{op}``, ``GET /v1/health`` (no auth), ``GET /v1/openapi.json``.

    Calls run in worker threads, one at a time (``Endpoint``), so health checks are answered meanwhile."""
    endpoint = Endpoint(handler, max_request_bytes=max_request_bytes, call_timeout_s=call_timeout_s)
    app = FastAPI(title="arctic-rl service", version=__version__, openapi_url=None, docs_url=None, redoc_url=None)
    def require_token(request: Request) -> None:
        check_bearer(request.headers.get("authorization"), auth_token)  # constant time; AuthError (401)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return _error_response(error)

    @app.get("/v1/health")
    async def health() -> dict:
        """Liveness, without auth: answered even while an operation runs."""
        return {"status": "ok", "version": __version__, "protocol": wire.PROTOCOL_VERSION,
                "max_request_bytes": max_request_bytes}

    @app.get("/v1/openapi.json", dependencies=[Depends(require_token)], include_in_schema=False)
    async def openapi() -> dict:
        return app.openapi()

    @app.post("/v1/ops/{op}", dependencies=[Depends(require_token)], response_class=Response,
              openapi_extra=_OP_DOC, responses=_OP_RESPONSES)
    async def run_op(op: str, request: Request) -> Response:
        """Run one operation: the body is a wire request for ``op``, the reply a wire message."""
        received_at = time.monotonic()
        try:
            body = await _read_body(request, max_request_bytes)
            reply = await run_in_threadpool(endpoint.answer, op, body, received_at)
        except Exception as e:  # noqa: BLE001  (every failure is an answer; the server keeps serving)
            return _error_response(e)
        except asyncio.CancelledError:  # uvicorn's graceful shutdown ran out while the op ran
            return _error_response(JobFailed(f"the server shut down while {op!r} was running"))
        return Response(reply, media_type=wire.CONTENT_TYPE)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) from its Content-Length, or as soon as a chunked body passes ``limit``."""
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip() != wire.CONTENT_TYPE:
        raise RequestError(f"the content type must be {wire.CONTENT_TYPE}, got {content_type!r}")
    return await read_limited(request, limit)


async def read_limited(request: Request, limit: int) -> bytes:
    """The body, refused (``PayloadTooLarge``, 413) from its Content-Length, or as soon as a chunked body passes ``limit``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body is {declared} bytes, over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error_response(error: Exception) -> JSONResponse:
    """``{"error": class name, "message": ...}`` with the error's status (500 for anything not ours)."""
    if not isinstance(error, ServiceError):
        logger.error("answering 500: %s: %s", type(error).__name__, error)
    status = error.status if isinstance(error, ServiceError) else 500
    return JSONResponse(wire.error_fields(error), status_code=status)
