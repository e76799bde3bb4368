"""The Tinker transport's server side (``arctic-rl serve --api tinker``): a FastAPI app answering the Tinker SDK's
routes (docs/tinker.md) with ``TinkerService``. It only translates: JSON or protobuf in, a call, JSON or
protobuf out; a refusal is the SDK's ``{"error", "category"}`` with a 4xx status."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from arctic_rl.serve.errors import RequestError, ServiceError, UnknownOperation
from arctic_rl.serve.transports.http_app import read_limited
from arctic_rl.serve.security import check_api_key
from arctic_rl.serve.tinker.batch import TinkerInputError
from arctic_rl.serve.tinker.service import TinkerService, error_body, new_model_id
from arctic_rl.serve.tinker.wire import read_forward_backward
from arctic_rl.serve.wire import readable_json

logger = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"
RETRIEVE_WAIT_S = 20.0  # how long retrieve_future holds a request for a running operation (the SDK waits 45 s)
CLIENT_CONFIG = {  # the SDK's feature flags (ClientConfigResponse): the plain paths this server implements
    "pjwt_auth_enabled": False, "credential_default_source": "api_key", "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


def create_tinker_app(service: TinkerService, *, auth_token: str | None, max_request_bytes: int) -> FastAPI:
    """The app: the Tinker SDK's routes over ``service``; every route but ``healthz`` needs the token."""
    app = FastAPI(title="arctic-rl Tinker API", openapi_url=None, docs_url=None, redoc_url=None)

    def require_key(request: Request) -> None:
        check_api_key(request.headers.get("x-api-key"), request.headers.get("authorization"), auth_token)

    @app.exception_handler(ServiceError)
    @app.exception_handler(TinkerInputError)
    async def refused(request: Request, error: Exception) -> JSONResponse:
        return error_response(error)

    async def body(request: Request) -> dict[str, Any]:
        raw = await read_limited(request, max_request_bytes)
        try:
            parsed = json.loads(raw or b"{}")
        except ValueError as e:
            raise RequestError(f"{request.url.path}: the body is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise RequestError(f"{request.url.path}: the body must be a JSON object")
        return parsed

    def route(path: str, methods=("POST",)):
        return app.api_route(f"/api/v1/{path}", methods=list(methods), dependencies=[Depends(require_key)])

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @route("client/config")
    async def client_config() -> dict:
        return CLIENT_CONFIG

    @route("client/dynamic_config")
    async def client_dynamic_config() -> dict:
        return {}  # the SDK's defaults

    @route("create_session")
    async def create_session() -> dict:
        return {"type": "create_session", "session_id": f"session-{uuid.uuid4().hex[:12]}"}

    @route("session_heartbeat")
    async def session_heartbeat() -> dict:
        return {"type": "session_heartbeat"}

    @route("sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> dict:
        return {}

    @route("telemetry")
    async def telemetry() -> dict:
        return {"status": "accepted"}  # the SDK's telemetry is not kept

    @route("get_server_capabilities", methods=("GET",))
    async def capabilities() -> dict:
        return service.capabilities()

    @route("create_model")
    async def create_model(request: Request) -> dict:
        req = await body(request)
        new_model_id(req)  # a bad session_id is refused at once, before anything is queued
        return service.submit(lambda: service.create_model(req))

    @route("get_info")
    async def get_info(request: Request) -> dict:
        return await run_in_threadpool(service.info, await body(request))

    @route("forward_backward")
    async def forward_backward(request: Request) -> dict:
        if request.headers.get("content-encoding"):
            raise RequestError(f"content-encoding {request.headers['content-encoding']!r} is not supported; send it plain")
        call = read_forward_backward(await read_limited(request, max_request_bytes))
        return service.submit(lambda: service.forward_backward(call), call.model_id)

    def queued(operation):  # a JSON body run as a future in the model's queue, like forward_backward
        async def handler(request: Request) -> dict:
            req = await body(request)
            return service.submit(lambda: operation(req), req.get("model_id"))
        return handler

    for path, operation in (("optim_step", service.optim_step), ("save_weights_for_sampler", service.save_weights_for_sampler),
                            ("save_weights", service.save_weights), ("load_weights", service.load_weights)):
        route(path)(queued(operation))

    @route("create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        return service.create_sampling_session(await body(request))

    @route("samplers/{session}", methods=("GET",))
    async def sampler(session: str) -> dict:
        return service.sampler(session)

    @route("asample")
    async def asample(request: Request) -> dict:
        return service.submit_sample(await body(request))

    @route("retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = await body(request)
        future = service.future(str(req.get("request_id")))
        if future is None:
            raise UnknownOperation(f"unknown request_id {req.get('request_id')!r} (never issued here, or long forgotten)")
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), RETRIEVE_WAIT_S)
        except asyncio.TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": req["request_id"], "queue_state": "active"})
        except Exception as e:  # noqa: BLE001  (the operation's failure is the future's answer)
            return JSONResponse(error_body(e))
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return JSONResponse(readable_json(result))  # a non-finite metric as "NaN"/"Infinity": the SDK reads it

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(path: str, request: Request) -> Response:
        raise UnknownOperation(f"{request.method} /{path} is not part of arctic-rl's Tinker API (docs/tinker.md)")

    return app


def error_response(error: Exception) -> JSONResponse:
    """The SDK's ``{"error", "category"}`` with the error's status (400 for a refused Tinker input, 500 for a fault)."""
    if isinstance(error, TinkerInputError):
        status = 400
    elif isinstance(error, ServiceError):
        status = error.status
    else:
        logger.error("answering 500: %s: %s", type(error).__name__, error)
        status = 500
    return JSONResponse(error_body(error), status_code=status)
